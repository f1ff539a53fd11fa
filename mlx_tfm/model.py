"""The Transformer, as the classic explanations draw it, in one configurable implementation.

Every variant (RMSNorm or LayerNorm; pre-, post- or sandwich norm; SwiGLU, GeGLU, GELU,
ReLU; MHA, MQA, GQA; RoPE, learned or sinusoidal positions; tied embeddings; biases;
soft-capping) is a field of the frozen ``ModelArgs``. This file holds only math: loading,
converting and sampling live elsewhere. Parameter names follow Hugging Face's Llama
(``model.layers.N.self_attn.q_proj``...), so checkpoints load by near-copy.

Shapes: B batch, L new positions, S cached positions, D hidden size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .attention import attention
from .cache import CrossAttentionCache, KVCache, RotatingKVCache, window_mask
from .cpu import linear as cpu_linear
from .cpu import pointwise as cpu_pointwise
from .cpu.switch import evaluates_each_sublayer
from .experts import SparseMoeBlock, clamped_swiglu
from .positions import SinusoidalPositions, make_rope, position_ids
from .relative_positions import relative_position_bias


@dataclass(frozen=True)
class ModelArgs:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 0  # 0: derived by from_dict (= num_attention_heads, MHA)
    head_dim: int = 0  # 0: derived by from_dict (= hidden_size // num_attention_heads)
    intermediate_size: int = 11008
    # normalisation
    norm_type: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only
    norm_weight_offset: float = 0.0  # Gemma scales by (1 + weight)
    # "pre" | "post" (original Transformer) | "sandwich" (Gemma 2: each sublayer's input and
    # output) | "post_sublayer" (OLMo 2: only each sublayer's output) | "parallel" (Phi-2,
    # Cohere: attention and MLP both read one norm of x and both add to x)
    norm_placement: str = "pre"
    residual: bool = True  # False drops the skip connections (a gradient-flow ablation)
    residual_scale: float = 1.0  # Granite: each sublayer's output times this joins the residual
    final_norm: bool = True
    # feed-forward
    hidden_act: str = "silu"  # "silu" | "gelu" | "gelu_tanh" | "relu" | "relu2"
    ffn_gated: bool = True  # act(gate(x)) * up(x): SwiGLU with silu, GeGLU with gelu
    mlp_bias: bool = False
    # attention
    attention_bias: bool = False  # q, k, v projections
    attention_out_bias: bool = False  # o projection
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    qk_norm_scope: str = "head"  # "head" | "projection" (OLMo 2: one norm over all heads of q, of k)
    attention_scale: float = 0.0  # 0: derived (1/sqrt(head_dim))
    attn_logit_softcapping: float | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head that takes softmax mass
    clip_qkv: float | None = None  # OLMoE: q, k and v clipped to [-clip_qkv, clip_qkv]
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"
    # positions
    position_embedding: str = "rope"  # "rope" | "learned" | "sinusoidal" | "none"
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # Gemma 3, OLMo 3: sliding layers' own base, never scaled
    rope_layers: tuple[bool, ...] = ()  # per layer: rotate q and k? () = every layer (SmolLM 3 skips some)
    rope_traditional: bool = False  # True: rotate adjacent pairs (GPT-J, llama2.c)
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3"|"yarn", ...}
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    # embeddings and head
    tie_word_embeddings: bool = True
    embedding_scale: float | None = None  # Gemma: sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    logit_scale: float = 1.0  # Cohere multiplies the logits, Granite divides them
    lm_head_bias: bool = False  # Phi-2
    # mixture of experts (mlx_tfm/experts.py); num_experts 0: every layer dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # 0: derived (= intermediate_size)
    router_scoring: str = "softmax"  # "softmax" | "topk_softmax" | "sigmoid" (experts.route)
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    router_bias: bool = False  # gpt-oss: the router has a bias
    routed_scaling_factor: float = 1.0  # sigmoid routers: weights times this
    n_group: int = 1  # sigmoid routers: experts chosen from the best topk_group of n_group groups
    topk_group: int = 1
    expert_bias: bool = False  # gpt-oss: the experts' projections have biases
    swiglu_limit: float | None = None  # gpt-oss: the experts' clamped SwiGLU (experts.clamped_swiglu)
    swiglu_alpha: float = 1.0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE, GLM-4.5: a dense FFN beside the experts
    shared_expert_gate: bool = False  # Qwen2-MoE: ... scaled by sigmoid(shared_expert_gate(x))
    # dense layers mixed in: layer i has experts unless i in mlp_only_layers,
    # (i + 1) % decoder_sparse_step != 0 or i < first_k_dense_replace
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    # the three architectures (README "Three architectures"): "decoder" (GPT, Llama),
    # "encoder" (BERT family: bidirectional, mlx_tfm/encoders.py) or "encoder-decoder" (T5)
    kind: str = "decoder"
    # encoders' embeddings: token types (BERT), a norm over the summed embeddings (BERT,
    # ModernBERT), learned positions after an offset (RoBERTa, XLM-R: padding_idx + 1)
    type_vocab_size: int = 0
    embedding_norm: bool = False
    position_offset: int = 0
    first_layer_norm: bool = True  # False: layer 0 reads the normed embeddings as they are (ModernBERT)
    # T5: a learned bias per head for buckets of key - query distance (mlx_tfm/relative_positions.py)
    relative_attention_num_buckets: int = 0
    relative_attention_max_distance: int = 128
    cross_attention: bool = False  # decoder blocks of an encoder-decoder: queries over the encoder's output
    own_embeddings: bool = True  # False: the stack receives embedded inputs (T5's stacks share one table)
    num_decoder_layers: int = 0  # encoder-decoder: 0 = num_hidden_layers
    decoder_start_token_id: int = 0
    # encoders' heads (mlx_tfm/heads.py): "none" (hidden states), "masked_lm", "classification"
    head: str = "none"
    num_labels: int = 0
    head_activation: str = "gelu"  # masked LM: dense -> this -> LayerNorm -> decoder
    head_bias: bool = True  # the heads' dense layers
    decoder_bias: bool = True  # the masked-LM decoder's bias
    classifier_pooling: str = "cls"  # "cls" | "mean"
    classifier_activation: str = "tanh"
    classifier_norm: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a dict, ignoring unknown keys and deriving the defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in params.items() if k in names and v is not None}
        n_heads = values.get("num_attention_heads", cls.num_attention_heads)
        hidden = values.get("hidden_size", cls.hidden_size)
        n_layers = values.get("num_hidden_layers", cls.num_hidden_layers)
        values.setdefault("num_key_value_heads", n_heads)
        values["num_key_value_heads"] = values["num_key_value_heads"] or n_heads
        check_head_counts(n_heads, values["num_key_value_heads"], hidden, values.get("head_dim"))
        values["head_dim"] = values.get("head_dim") or hidden // n_heads
        values["attention_scale"] = values.get("attention_scale") or values["head_dim"] ** -0.5
        window = values.get("sliding_window")
        default_type = "sliding_attention" if window else "full_attention"
        values["layer_types"] = tuple(values.get("layer_types") or (default_type,) * n_layers)
        if len(values["layer_types"]) != n_layers:
            raise ValueError(f"layer_types has {len(values['layer_types'])} entries for {n_layers} layers")
        values["rope_layers"] = tuple(bool(r) for r in values.get("rope_layers", ()))
        if values["rope_layers"] and len(values["rope_layers"]) != n_layers:
            raise ValueError(f"rope_layers has {len(values['rope_layers'])} entries for {n_layers} layers")
        values.update(cls._expert_values(values))
        return cls(**values)

    @classmethod
    def _expert_values(cls, values: dict) -> dict:
        n_experts, per_token = values.get("num_experts", 0), values.get("num_experts_per_tok", 0)
        if n_experts and not 0 < per_token <= n_experts:
            raise ValueError(f"num_experts_per_tok is {per_token}; it must be between 1 and num_experts ({n_experts})")
        return {
            "moe_intermediate_size": values.get("moe_intermediate_size") or values.get("intermediate_size",
                                                                                       cls.intermediate_size),
            "mlp_only_layers": tuple(values.get("mlp_only_layers", ())),
        }

    def has_experts(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s feed-forward is a mixture of experts."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0 and layer_idx >= self.first_k_dense_replace)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["rope_layers"] = list(self.rope_layers)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d


def check_head_counts(n_heads: int, n_kv_heads: int, hidden_size: int, head_dim: int | None) -> None:
    """ValueError naming the numbers when the attention heads cannot be laid out: each KV
    head serves a whole group of query heads, and without an explicit head_dim the heads
    split hidden_size evenly."""
    for name, count in (("num_attention_heads", n_heads), ("num_key_value_heads", n_kv_heads)):
        if count < 1:
            raise ValueError(f"{name} must be at least 1, not {count}")
    if n_heads % n_kv_heads:
        raise ValueError(f"num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv_heads})")
    if not head_dim and hidden_size % n_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({n_heads}) and there is no head_dim"
        )


# -- building blocks ---------------------------------------------------------------


# On MLX's CPU backend the mx.fast norms and RoPE are chains of primitive ops: mlx_tfm's
# kernels take them where they are in use (mlx_tfm/cpu/pointwise.py); otherwise compiling
# fuses each chain into one kernel. On Metal they are single kernels already.
@partial(mx.compile, shapeless=True)
def fused_rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.weight = mx.ones((dims,)) if weight_offset == 0 else mx.zeros((dims,))
        self.eps = eps
        self.weight_offset = weight_offset

    def __call__(self, x: mx.array) -> mx.array:
        weight = self.weight + self.weight_offset if self.weight_offset else self.weight
        if cpu_pointwise.in_use():
            return cpu_pointwise.rms_norm(x, weight, self.eps)
        return fused_rms_norm(x, weight, self.eps)


def make_norm(args: ModelArgs, dims: int | None = None) -> nn.Module:
    dims = dims or args.hidden_size
    if args.norm_type == "rmsnorm":
        return RMSNorm(dims, args.norm_eps, args.norm_weight_offset)
    if args.norm_type == "layernorm":
        return nn.LayerNorm(dims, eps=args.norm_eps, bias=args.norm_bias)
    raise ValueError(f"unknown norm_type {args.norm_type!r} (rmsnorm, layernorm)")


ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": nn.gelu,  # exact, through erf
    "gelu_tanh": nn.gelu_approx,  # 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
    "relu": nn.relu,
    "relu2": lambda x: mx.square(nn.relu(x)),  # Primer's squared ReLU (Arcee)
}


@lru_cache(maxsize=None)
def gated_activation(name: str):
    """``act(gate) * up`` as one fused kernel."""
    act = ACTIVATIONS[name]
    return mx.compile(lambda gate, up: act(gate) * up, shapeless=True)


class MLP(nn.Module):
    """The position-wise FFN: gated (SwiGLU, GeGLU) or the classic two-layer form."""

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        if args.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unknown hidden_act {args.hidden_act!r} ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[args.hidden_act]
        self.gated = args.ffn_gated
        self.gated_act = gated_activation(args.hidden_act)
        self.silu = args.hidden_act == "silu"
        D, F, bias = args.hidden_size, intermediate_size or args.intermediate_size, args.mlp_bias
        if self.gated:
            self.gate_proj = nn.Linear(D, F, bias=bias)
        self.up_proj = nn.Linear(D, F, bias=bias)
        self.down_proj = nn.Linear(F, D, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        if self.gated and self.silu:
            fused = cpu_linear.fused_products((self.gate_proj, self.up_proj), x, gated=True)
            if fused:
                return self.down_proj(fused[0])
        if self.gated and self.silu and cpu_pointwise.in_use():
            return self.down_proj(cpu_pointwise.silu_mul(self.gate_proj(x), self.up_proj(x)))
        if self.gated:
            return self.down_proj(self.gated_act(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act(self.up_proj(x)))


def feed_forward(args: ModelArgs, layer_idx: int) -> nn.Module:
    """The layer's FFN: the dense MLP, or a mixture of experts (with its shared expert)."""
    if not args.has_experts(layer_idx):
        return MLP(args)
    shared = MLP(args, args.shared_expert_intermediate_size) if args.shared_expert_intermediate_size else None
    if args.swiglu_limit is not None:
        activation = clamped_swiglu(args.swiglu_alpha, args.swiglu_limit)
    else:
        activation = gated_activation(args.hidden_act)
    return SparseMoeBlock(args, activation, shared)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        D = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.attention_scale
        self.softcap = args.attn_logit_softcapping
        self.q_proj = nn.Linear(D, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, D, bias=args.attention_out_bias)
        if args.attention_sinks:
            self.sinks = mx.zeros((self.n_heads,))
        self.clip_qkv = args.clip_qkv
        # q/k norm over each head (Qwen 3, Gemma 3) or over the whole projection (OLMo 2)
        self.qk_norm_scope = args.qk_norm_scope if args.qk_norm else None
        if self.qk_norm_scope not in (None, "head", "projection"):
            raise ValueError(f"unknown qk_norm_scope {args.qk_norm_scope!r} (head, projection)")
        if args.qk_norm:
            per_head = self.qk_norm_scope == "head"
            q_dims = self.head_dim if per_head else self.n_heads * self.head_dim
            k_dims = self.head_dim if per_head else self.n_kv_heads * self.head_dim
            self.q_norm = RMSNorm(q_dims, args.norm_eps, args.norm_weight_offset)
            self.k_norm = RMSNorm(k_dims, args.norm_eps, args.norm_weight_offset)
        rotates = args.position_embedding == "rope" and (not args.rope_layers or args.rope_layers[layer_idx])
        self.rope = make_rope(args, args.layer_types[layer_idx]) if rotates else None

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if isinstance(cache, CrossAttentionCache):
            return self._cross_attention(x, cache)
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        ready = self._decoding_heads(x, offset) if L == 1 else None
        queries, keys, values = ready or self._heads(x, offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = attention(queries, keys, values, self.scale, mask, self.softcap, self.get("sinks"))
        # (B, n_heads, L, head_dim) -> (B, L, n_heads * head_dim)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out)

    def _decoding_heads(self, x: mx.array, offset) -> list[mx.array] | None:
        """``_heads`` for one position in one call of the CPU kernels (products, layout and
        RoPE together), where they take it and nothing comes between the products and RoPE
        (clipping, q/k norms, YaRN's scaling); else None."""
        if self.clip_qkv is not None or self.qk_norm_scope is not None:
            return None
        rope = self.rope
        if rope is not None and rope.attention_factor != 1.0:
            return None
        settings = None if rope is None else (offset, rope.periods, rope.dims, rope.traditional, rope.scale)
        return cpu_linear.fused_products((self.q_proj, self.k_proj, self.v_proj), x,
                                         heads=(self.n_heads, self.n_kv_heads, self.n_kv_heads), rope=settings)

    def _heads(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values (B, heads, L, head_dim), queries and keys rotated to
        their positions (from ``offset``)."""
        B, L, _ = x.shape
        projected = cpu_linear.fused_products((self.q_proj, self.k_proj, self.v_proj), x)
        queries, keys, values = projected or (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if self.clip_qkv is not None:
            queries, keys, values = (mx.clip(t, -self.clip_qkv, self.clip_qkv) for t in (queries, keys, values))
        if self.qk_norm_scope == "projection":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        # (B, L, n_heads * head_dim) -> (B, L, n_heads, head_dim)
        queries = queries.reshape(B, L, self.n_heads, self.head_dim)
        keys = keys.reshape(B, L, self.n_kv_heads, self.head_dim)
        values = values.reshape(B, L, self.n_kv_heads, self.head_dim)
        if self.qk_norm_scope == "head":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        # -> (B, heads, L, head_dim), the layout attention and the cache work in
        queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
        if self.rope is not None:
            queries, keys = self.rope(queries, offset), self.rope(keys, offset)
        return queries, keys, values

    def _cross_attention(self, x: mx.array, cross: CrossAttentionCache) -> mx.array:
        """Queries from the decoder's ``x``, keys and values from the encoder's output,
        projected once per input (``CrossAttentionCache``); no positions, no causal mask."""
        B, L, _ = x.shape
        # (B, L, n_heads * head_dim) -> (B, n_heads, L, head_dim)
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        keys, values = cross.fetch(self._project_memory)
        out = attention(queries, keys, values, self.scale, cross.mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _project_memory(self, memory: mx.array) -> tuple[mx.array, mx.array]:
        B, S, _ = memory.shape
        # (B, S, n_kv_heads * head_dim) -> (B, n_kv_heads, S, head_dim)
        keys = self.k_proj(memory).reshape(B, S, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        values = self.v_proj(memory).reshape(B, S, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return keys, values


# Which norms each placement has, by their checkpoint names.
BLOCK_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "post": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "post_sublayer": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "parallel": ("input_layernorm",),
}


def settled(h: mx.array) -> mx.array:
    """``h`` (B, L, D), evaluated now while a prompt is read one sublayer at a time
    (``prompt_layer_by_layer``: after each attention and each FFN), so the next
    sublayer's graph is built after; unchanged otherwise."""
    if h.shape[1] > 1 and evaluates_each_sublayer():
        mx.eval(h)
    return h


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.placement = args.norm_placement
        self.residual = args.residual
        self.residual_scale = args.residual_scale
        if self.placement not in BLOCK_NORMS:
            raise ValueError(f"unknown norm_placement {self.placement!r} ({', '.join(BLOCK_NORMS)})")
        if not self.residual and self.placement not in ("pre", "post"):
            raise ValueError("residual=False is only defined for the pre and post placements")
        self.self_attn = Attention(args, layer_idx)
        self.mlp = feed_forward(args, layer_idx)
        for name in BLOCK_NORMS[self.placement]:
            setattr(self, name, make_norm(args))
        if layer_idx == 0 and not args.first_layer_norm:
            self.input_layernorm = nn.Identity()  # ModernBERT: the embeddings are normed already
        if args.cross_attention:
            if self.placement != "pre":
                raise ValueError("cross-attention is only defined for the pre-norm placement")
            self.cross_attn = Attention(args, layer_idx)
            self.cross_attn_layernorm = make_norm(args)

    def __call__(self, x: mx.array, mask=None, cache=None, cross: CrossAttentionCache | None = None) -> mx.array:
        if not self.residual:
            return self._without_residual(x, mask, cache)
        if self.placement == "post":
            # The original Transformer: normalise after each residual addition.
            h = settled(self.input_layernorm(x + self.self_attn(x, mask, cache)))
            return self.post_attention_layernorm(h + self.mlp(h))
        if self.placement == "pre":
            # The residual stream as the seed draws it: each sublayer adds to x.
            h = settled(x + self._scaled(self.self_attn(self.input_layernorm(x), mask, cache)))
            if cross is not None:  # encoder-decoder: the decoder reads the encoder's output
                h = settled(h + self.cross_attn(self.cross_attn_layernorm(h), None, cross))
            return h + self._scaled(self.mlp(self.post_attention_layernorm(h)))
        if self.placement == "parallel":
            # Phi-2, Cohere: both sublayers read the same normalised x.
            normed = self.input_layernorm(x)
            return x + self.self_attn(normed, mask, cache) + self.mlp(normed)
        if self.placement == "post_sublayer":
            # OLMo 2: normalise each sublayer's output only.
            h = settled(x + self.post_attention_layernorm(self.self_attn(x, mask, cache)))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        # Gemma 2 and 3: normalise each sublayer's input and its output.
        h = settled(x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache)))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def _scaled(self, y: mx.array) -> mx.array:
        return y * self.residual_scale if self.residual_scale != 1.0 else y

    def _without_residual(self, x: mx.array, mask, cache) -> mx.array:
        """The same sublayers and norms with no skip connections: each sublayer's output
        replaces the stream instead of adding to it (only for gradient-flow experiments)."""
        if self.placement == "post":
            h = self.input_layernorm(self.self_attn(x, mask, cache))
            return self.post_attention_layernorm(self.mlp(h))
        h = self.self_attn(self.input_layernorm(x), mask, cache)
        return self.mlp(self.post_attention_layernorm(h))


def bidirectional_window(mask, length: int, window: int):
    """An encoder's sliding-window layer (ModernBERT's local attention): position i sees
    j when |i - j| <= window, and j is a token (``mask`` (B, 1, 1, S) or None)."""
    positions = mx.arange(length)
    band = mx.abs(positions[:, None] - positions[None, :]) <= window  # (L, L)
    return band if mask is None else band & mask


class TransformerModel(nn.Module):
    """Embeddings, the stack of blocks, the final norm: ``model.*`` in checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        if args.own_embeddings:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if args.position_embedding == "learned":
            self.embed_positions = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        elif args.position_embedding == "sinusoidal":
            self.sinusoidal = SinusoidalPositions(args.hidden_size)
        if args.type_vocab_size:
            self.embed_token_types = nn.Embedding(args.type_vocab_size, args.hidden_size)
        if args.embedding_norm:
            self.embed_norm = make_norm(args)
        if args.relative_attention_num_buckets:
            self.relative_attention_bias = nn.Embedding(args.relative_attention_num_buckets, args.num_attention_heads)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.windows = [args.sliding_window if t == "sliding_attention" else None for t in args.layer_types]
        if args.final_norm:
            self.norm = make_norm(args)

    def __call__(self, inputs: mx.array, mask=None, cache=None, token_type_ids: mx.array | None = None,
                 cross: list[CrossAttentionCache] | None = None) -> mx.array:
        """Token ids (B, L), or embedded inputs (B, L, D) when the stack does not own its
        embeddings, -> hidden states (B, L, D). Encoders (kind "encoder") attend both ways:
        ``mask`` is then their padding mask (B, 1, 1, S), True at tokens. ``cross``: one
        ``CrossAttentionCache`` per layer of an encoder-decoder's decoder."""
        B, L = inputs.shape[:2]
        h = self.embed_tokens(inputs) if self.args.own_embeddings else inputs  # (B, L, D)
        if self.args.embedding_scale is not None:
            h = h * mx.array(self.args.embedding_scale, dtype=h.dtype)
        offset = cache[0].offset if cache is not None else 0
        if self.args.position_embedding == "learned":
            positions = position_ids(offset, L) + self.args.position_offset  # offset: int, or (B,) per row
            h = h + self.embed_positions(positions)
        elif self.args.position_embedding == "sinusoidal":
            h = h + self.sinusoidal(offset, L).astype(h.dtype)
        if self.args.type_vocab_size:
            types = token_type_ids if token_type_ids is not None else mx.zeros((B, L), mx.int32)
            h = h + self.embed_token_types(types)
        if self.args.embedding_norm:
            h = self.embed_norm(h)
        masks = self._stack_masks(mask, L, cache, h.dtype)
        cache = cache if cache is not None else [None] * len(self.layers)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if cross is None:
                h = settled(layer(h, masks[i], layer_cache))
            else:
                h = settled(layer(h, masks[i], layer_cache, cross[i]))
        return self.norm(h) if self.args.final_norm else h

    def _stack_masks(self, mask, length: int, cache, dtype: mx.Dtype) -> list:
        """The mask each layer attends with (computed before any layer updates its cache).
        Decoders: ``mask`` as given, else causal and windowed from each cache; encoders:
        the padding ``mask`` both ways, banded on sliding-window layers; stacks with T5's
        relative position bias: one additive mask shared by every layer."""
        if self.args.relative_attention_num_buckets:
            return [self._biased_mask(mask, length, cache, dtype)] * len(self.layers)
        if self.args.kind == "encoder":
            return [mask if window is None else bidirectional_window(mask, length, window) for window in self.windows]
        caches = cache if cache is not None else [None] * len(self.layers)
        return [mask if mask is not None else self._mask(length, c, w) for c, w in zip(caches, self.windows)]

    def _biased_mask(self, mask, length: int, cache, dtype: mx.Dtype) -> mx.array:
        """T5: the relative position bias (1, n_heads, L, S) of queries at the cache's
        offset, with the padding (encoder) or causal (decoder) mask as the lowest number."""
        offset = cache[0].offset if cache is not None else 0
        encoder = self.args.kind == "encoder"
        bias = relative_position_bias(self.relative_attention_bias.weight, range(offset, offset + length), offset + length,
                                      encoder, self.args.relative_attention_max_distance).astype(dtype)
        if encoder:
            visible = mask
        else:
            visible = window_mask(mx.arange(offset, offset + length), mx.arange(offset + length), None) if length > 1 else None
        return bias if visible is None else mx.where(visible, bias, mx.finfo(dtype).min)

    @staticmethod
    def _mask(length: int, cache, window: int | None):
        if cache is not None:
            return cache.make_mask(length, window)
        if window is not None and length > window:
            positions = mx.arange(length)
            return window_mask(positions, positions, window)
        return "causal" if length > 1 else None


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if not args.num_key_value_heads or not args.head_dim or not args.attention_scale:
            raise ValueError("build ModelArgs with ModelArgs.from_dict, which derives head_dim and friends")
        if args.num_attention_heads % args.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.args = args
        self.model = TransformerModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=args.lm_head_bias)

    def __call__(self, inputs: mx.array, mask=None, cache: list | None = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab_size)."""
        return self.head(self.model(inputs, mask, cache))

    def head(self, h: mx.array) -> mx.array:
        """Final hidden states (B, L, D) -> logits (B, L, vocab_size). Separate so that
        training can compute the loss over the vocabulary a chunk of positions at a time."""
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        if self.args.logit_scale != 1.0:
            logits = logits * self.args.logit_scale
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def make_cache(self, max_kv_size: int | None = None, keep: int = 0) -> list:
        """One cache per layer. Sliding-window layers never need more than their window;
        ``max_kv_size`` bounds every layer with a rotating cache."""
        caches = []
        for window in self.model.windows:
            bound = min(b for b in (window, max_kv_size) if b is not None) if (window or max_kv_size) else None
            caches.append(RotatingKVCache(bound, keep=keep if bound == max_kv_size else 0) if bound else KVCache())
        return caches


def count_parameters(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(module.parameters()))


__all__ = ["ModelArgs", "Model", "count_parameters"]
