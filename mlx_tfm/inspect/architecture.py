"""A model's architecture in words, the bytes its KV cache needs, and its FLOPs per token.

**In words**: the ``ModelArgs`` fields that differ from a plain Llama of the same sizes
(``ModelArgs.from_dict`` of the sizes alone: pre-norm RMSNorm, SwiGLU, RoPE, MHA, no
biases, tied head). A field the table below does not know is still reported, as
``field = value``, so a new option (experts, say) shows up without a change here.

**KV cache**: each layer keeps a key and a value vector of ``head_dim`` for each of its
``n_kv_heads`` at each position it holds (every position, or the last ``window`` for a
sliding-window layer). In float16 a vector is ``2 * head_dim`` bytes; quantized in MLX's
affine layout (``mx.quantize`` over head_dim, as mlx-lm's quantized cache does) it is
``head_dim * bits / 8`` bytes of values plus a float16 scale and bias per group.

**FLOPs per generated token** at position T (it attends to T positions, or the window):
``2 * M + 4 * n_heads * head_dim * sum over layers of min(T, window)``, where M is every
matrix weight in the blocks plus the head's ``vocab * d`` (one multiply and one add each;
the embedding lookup is free), and the second term is q k^T and the weighted sum of V.
Norms, activations and the softmax (O(d) per token) are left out. With experts, every
expert's weights count: an upper bound.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..model.cache import default_kv_group_size
from ..model.config import ModelArgs
from ..model.mixers import ATTENTION_TYPES
from .parts import Part

SIZE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "max_position_embeddings")
SCALE_BYTES = 2  # float16 scale and bias per group


def plain_llama(args: ModelArgs) -> ModelArgs:
    return ModelArgs.from_dict({name: getattr(args, name) for name in SIZE_FIELDS})


def summary(args: ModelArgs) -> str:
    """'llama: 5 layers, d 64, 8 heads x 8, d_ff 172, vocab 512, context 512'."""
    return (f"{args.model_type}: {args.num_hidden_layers} layers, d {args.hidden_size}, "
            f"{args.num_attention_heads} heads x {args.head_dim}, d_ff {args.intermediate_size}, "
            f"vocab {args.vocab_size}, context {args.max_position_embeddings}")


def _kv_heads(a: ModelArgs) -> str:
    if a.num_key_value_heads == 1:
        return f"MQA: all {a.num_attention_heads} query heads share one key/value head"
    per = a.num_attention_heads // a.num_key_value_heads
    return f"GQA: {a.num_attention_heads} query heads share {a.num_key_value_heads} key/value heads ({per} each)"


def _ffn(a: ModelArgs) -> str:
    gated = {"silu": "SwiGLU", "gelu": "GeGLU (exact GELU)", "gelu_tanh": "GeGLU (tanh GELU)", "relu": "ReGLU"}
    if a.ffn_gated:
        return f"FFN: {gated.get(a.hidden_act, a.hidden_act + ', gated')} (three matrices)"
    return f"FFN: two matrices with {a.hidden_act} between (not gated)"


def _windows(a: ModelArgs) -> str:
    sliding = sum(t == "sliding_attention" for t in a.layer_types)
    return f"sliding-window attention ({a.sliding_window} positions) in {sliding} of {a.num_hidden_layers} layers"


def _experts(a: ModelArgs) -> str:
    return f"mixture of experts: {a.num_experts} experts, {a.num_experts_per_tok} chosen for each token"


def _rope_scaling(a: ModelArgs) -> str:
    scaling = dict(a.rope_scaling or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", "?")
    return f"RoPE scaling {kind}, factor {scaling.get('factor', '?')}"


PLACEMENTS = {"post": "post-norm: each residual sum is normalised (the original Transformer)",
              "sandwich": "sandwich norm: each sublayer's input and output normalised (Gemma 2)"}
POSITIONS = {"learned": "learned absolute positions (GPT-2)", "sinusoidal": "sinusoidal positions (the original "
             "Transformer)", "none": "no position information"}

WORDS: dict[str, Callable[[ModelArgs], str]] = {
    "num_key_value_heads": _kv_heads,
    "head_dim": lambda a: f"head_dim {a.head_dim} (not d / heads = {a.hidden_size // a.num_attention_heads})",
    "norm_type": lambda a: f"{'LayerNorm' if a.norm_type == 'layernorm' else a.norm_type} instead of RMSNorm",
    "norm_eps": lambda a: f"norm epsilon {a.norm_eps:g}",
    "norm_bias": lambda a: "LayerNorm without a bias",
    "norm_weight_offset": lambda a: f"norms scale by ({a.norm_weight_offset:g} + weight) (Gemma)",
    "norm_placement": lambda a: PLACEMENTS.get(a.norm_placement, f"norm placement {a.norm_placement}"),
    "residual": lambda a: "no residual connections (an ablation)",
    "final_norm": lambda a: "no final norm",
    "hidden_act": _ffn,
    "ffn_gated": _ffn,
    "mlp_bias": lambda a: "FFN biases",
    "attention_bias": lambda a: "q, k, v biases",
    "attention_out_bias": lambda a: "output projection bias",
    "qk_norm": lambda a: "RMSNorm over each head of q and k (Qwen3)",
    "attention_scale": lambda a: f"attention scale {a.attention_scale:.4g} (not 1/sqrt(head_dim))",
    "attn_logit_softcapping": lambda a: f"attention scores soft-capped at {a.attn_logit_softcapping:g} (tanh)",
    "sliding_window": _windows,
    "layer_types": _windows,
    "position_embedding": lambda a: POSITIONS.get(a.position_embedding, a.position_embedding),
    "rope_theta": lambda a: f"RoPE base {a.rope_theta:g}",
    "rope_traditional": lambda a: "RoPE rotates adjacent pairs (GPT-J, llama2.c), not the two halves",
    "rope_scaling": _rope_scaling,
    "partial_rotary_factor": lambda a: f"RoPE on {a.partial_rotary_factor:.0%} of each head",
    "tie_word_embeddings": lambda a: "untied LM head (a vocab x d matrix of its own)",
    "embedding_scale": lambda a: f"embeddings scaled by {a.embedding_scale:.4g}",
    "final_logit_softcapping": lambda a: f"logits soft-capped at {a.final_logit_softcapping:g} (tanh)",
    "num_experts": _experts,
    "num_experts_per_tok": _experts,
}


def differences(args: ModelArgs) -> dict[str, object]:
    """The fields that differ from a plain Llama of the same sizes, with their values."""
    plain = plain_llama(args)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if getattr(args, f.name) != getattr(plain, f.name)}


def describe_architecture(args: ModelArgs) -> list[str]:
    """The differences from a plain Llama in words, one phrase each, in field order."""
    phrases = []
    for name, value in differences(args).items():
        words = WORDS.get(name)
        phrases.append(words(args) if words else f"{name} = {value!r}")
    return list(dict.fromkeys(phrases))


# -- the KV cache ---------------------------------------------------------------------


def positions_held(args: ModelArgs, context: int) -> list[int]:
    """How many positions each layer's KV cache holds after ``context`` tokens (0 for a
    recurrent layer: its state is no keys and values, ``layer_kinds.py``)."""
    windows = [args.sliding_window if kind == "sliding_attention" else None for kind in args.layer_types]
    held = [min(context, window) if window else context for window in windows]
    return [n if kind in ATTENTION_TYPES else 0 for n, kind in zip(held, args.layer_types)]


def kv_group_size(head_dim: int) -> int | None:
    """The group size the quantized cache uses for this head when none is given."""
    return default_kv_group_size(head_dim)


def vector_bytes(head_dim: int, dtype_bytes: int | None = None, bits: int | None = None) -> int | None:
    """Bytes of one key (or value) vector: plain, or quantized over head_dim with a
    float16 scale and bias per group (None when no group size divides head_dim)."""
    if bits is None:
        return head_dim * dtype_bytes
    group = kv_group_size(head_dim)
    if group is None:
        return None
    return head_dim * bits // 8 + 2 * SCALE_BYTES * (head_dim // group)


def kv_position_bytes(args: ModelArgs, dtype_bytes: int | None = 2, bits: int | None = None) -> int | None:
    """Bytes one position adds to one attention layer's cache: a key and a value per KV
    head; for MLA the normed latent and the rotary key it caches, one each for all heads
    (None: a quantized layout no group size fits)."""
    if args.kv_lora_rank:
        vectors = [vector_bytes(width, dtype_bytes, bits) for width in (args.kv_lora_rank, args.qk_rope_head_dim)]
        return None if None in vectors else sum(vectors)
    vector = vector_bytes(args.head_dim, dtype_bytes, bits)
    return None if vector is None else 2 * args.num_key_value_heads * vector


def kv_cache_bytes(args: ModelArgs, context: int, dtype_bytes: int | None = 2, bits: int | None = None) -> dict:
    """``{"per_token": ..., "at_context": ...}``: the bytes one more position adds while
    every layer still grows, and the bytes after ``context`` positions (None: a quantized
    layout no group size fits)."""
    per_position = kv_position_bytes(args, dtype_bytes, bits)
    if per_position is None:
        return {"per_token": None, "at_context": None}
    attention_layers = sum(kind in ATTENTION_TYPES for kind in args.layer_types)
    return {"per_token": per_position * attention_layers,
            "at_context": per_position * sum(positions_held(args, context))}


# -- FLOPs --------------------------------------------------------------------------


def matrix_weights(args: ModelArgs, parts: list[Part]) -> int:
    """M: the blocks' matrix weights plus the head's (tied or not, it is a vocab x d product)."""
    return sum(p.matrix_parameters for p in parts if p.layer is not None) + args.vocab_size * args.hidden_size


def flops_per_token(args: ModelArgs, parts: list[Part], position: int) -> int:
    """FLOPs to generate the token at ``position`` (it attends to that many positions)."""
    attended = sum(positions_held(args, position))
    return 2 * matrix_weights(args, parts) + 4 * args.num_attention_heads * args.head_dim * attended


__all__ = ["summary", "differences", "describe_architecture", "kv_cache_bytes", "kv_position_bytes", "kv_group_size",
           "matrix_weights", "flops_per_token"]
