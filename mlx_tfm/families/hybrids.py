"""Hybrid families: Gated DeltaNet linear-attention layers (``model/deltanet.py``) with a
full-attention layer every ``full_attention_interval`` (Qwen3-Next, Qwen3.5 and its MoE).

Their full-attention layers gate the attention output (``attn_output_gate``), norm q and k
per head and rotate a part of each head. Their RMSNorms scale by (1 + weight) in the
Hugging Face checkpoint; the on-disk layout is mlx-lm's, which stores (1 + weight) and the
convolution as MLX lays it out ((C, K, 1), not PyTorch's (C, 1, K)), so these models use a
plain RMSNorm. A Hugging Face checkpoint is told from an on-disk one by that convolution
shape, as mlx-lm tells them apart.

Qwen3-Next fuses its projections per key head (``in_proj_qkvz``: each key head's q, k, then
its value heads' v and z; ``in_proj_ba`` likewise b and a); they are split into Qwen3.5's
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` when loaded.
"""

from __future__ import annotations

import re

import mlx.core as mx

from ..model.config import ModelArgs
from .common import COMMON_DROPS, Architecture
from .decoders import llama_args
from .experts import moe_args, qwen_moe_layout

# The (1 + weight) norms of the Hugging Face checkpoints (the gated norm inside the linear
# attention is a plain one there too).
ZERO_CENTRED_NORMS = re.compile(r".*(input_layernorm|post_attention_layernorm|model\.norm|q_norm|k_norm)\.weight")
CONV_WEIGHT = re.compile(r".*\.linear_attn\.conv1d\.weight")


def layer_types_of(config: dict) -> list[str]:
    """``layer_types``, or every ``full_attention_interval``-th layer full (default 4)."""
    interval, n_layers = config.get("full_attention_interval", 4), config["num_hidden_layers"]
    default = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    return config.get("layer_types") or default


def hybrid_args(config: dict) -> dict:
    """The fields every hybrid family shares."""
    return {
        **llama_args(config),
        "layer_types": layer_types_of(config),
        "qk_norm": True,
        "attn_output_gate": True,
        "norm_weight_offset": 0.0,  # the on-disk layout stores (1 + weight)
    }


def shared_expert_args(config: dict, **fields) -> dict:
    return moe_args(config, shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
                    shared_expert_gate=True, **fields)


def qwen3_next_args(config: dict) -> dict:
    return {**hybrid_args(config), **shared_expert_args(config, decoder_sparse_step=config.get("decoder_sparse_step", 1),
                                                        mlp_only_layers=config.get("mlp_only_layers") or ())}


def qwen3_5_moe_text_args(config: dict) -> dict:
    # every layer a mixture; the chosen experts' weights always renormalised
    return {**hybrid_args(config), **shared_expert_args(config, norm_topk_prob=True)}


# -- layouts -----------------------------------------------------------------------------


def mlx_lm_norms_and_conv(weights: dict) -> dict:
    """Hugging Face tensors -> mlx-lm's: norms as (1 + weight), the convolution (C, K, 1).
    A checkpoint whose convolution is laid out so already is on-disk and passes through."""
    if not any(CONV_WEIGHT.fullmatch(n) and t.shape[-1] != 1 for n, t in weights.items()):
        return weights
    out = {}
    for name, tensor in weights.items():
        if CONV_WEIGHT.fullmatch(name):
            tensor = mx.moveaxis(tensor, 2, 1)  # (C, 1, K) -> (C, K, 1)
        elif ZERO_CENTRED_NORMS.fullmatch(name) and tensor.ndim == 1:
            tensor = tensor + 1.0
        out[name] = tensor
    return out


def text_experts(config: dict) -> dict:
    return config.get("text_config") or config


def hybrid_experts(weights: dict, config: dict) -> dict:
    return qwen_moe_layout(weights, text_experts(config))


def split_fused_projections(weights: dict, args: ModelArgs) -> dict:
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (rows grouped per key head) -> the
    separate projections GatedDeltaNet has; quantized rows (weights, scales, biases) alike."""
    n_key, per_key = args.linear_num_key_heads, args.linear_num_value_heads // max(args.linear_num_key_heads, 1)
    Dk, Dv = args.linear_key_head_dim, args.linear_value_head_dim
    pattern = re.compile(r"(.*)\.(in_proj_qkvz|in_proj_ba)\.(weight|scales|biases)")
    out = {}
    for name, tensor in weights.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, fused, kind = match.groups()
        parts = ({"qkv_q": Dk, "qkv_k": Dk, "qkv_v": per_key * Dv, "z": per_key * Dv} if fused == "in_proj_qkvz"
                 else {"b": per_key, "a": per_key})
        grouped = tensor.reshape(n_key, sum(parts.values()), *tensor.shape[1:])  # (Hk, rows per key head, ...)
        pieces, start = {}, 0
        for part, rows in parts.items():
            pieces[part] = grouped[:, start : start + rows].reshape(-1, *tensor.shape[1:])  # (Hk * rows, ...)
            start += rows
        if fused == "in_proj_qkvz":
            qkv = mx.concatenate([pieces["qkv_q"], pieces["qkv_k"], pieces["qkv_v"]])  # all q, all k, all v
            out[f"{prefix}.in_proj_qkv.{kind}"], out[f"{prefix}.in_proj_z.{kind}"] = qkv, pieces["z"]
        else:
            out[f"{prefix}.in_proj_b.{kind}"], out[f"{prefix}.in_proj_a.{kind}"] = pieces["b"], pieces["a"]
    return out


# Multi-token-prediction layers (``mtp.*``) are not part of the language model.
HYBRID_DROPS = COMMON_DROPS + (r"mtp\..*",)
# Routers and shared-expert gates stay at 8 bits, as mlx-lm's quant_predicate keeps them.
HYBRID_ROUTERS = r"(language_model\.)?model\.layers\.\d+\.mlp\.(gate|shared_expert_gate)"


def text_family(args, experts=None) -> Architecture:
    return Architecture(args=args, drops=HYBRID_DROPS, layout=mlx_lm_norms_and_conv, rewrite=split_fused_projections,
                        experts=experts, routers=HYBRID_ROUTERS if experts else None)


# Hybrid linear-attention families, by model_type (Qwen3.5's image-text checkpoints, qwen3_5
# and qwen3_5_moe, are qwen3_5_vl.py's).
HYBRIDS: dict[str, Architecture] = {
    "qwen3_next": text_family(qwen3_next_args, hybrid_experts),
    "qwen3_5_text": text_family(hybrid_args),
    "qwen3_5_moe_text": text_family(qwen3_5_moe_text_args, hybrid_experts),
}
