"""Families built on multi-head latent attention (``mlx_tfm/model/latent_attention.py``):
DeepSeek-V2, DeepSeek-V3 (also Kimi K2 and Moonlight) and GLM-4.7-Flash (glm4_moe_lite),
each a mixture of experts with shared experts and dense first layers.

Hugging Face keeps each layer's ``self_attn.kv_b_proj`` (H * (nope + v), R); we keep it
per head as mlx-lm does, ``embed_q`` (H, R, nope) and ``unembed_out`` (H, v, R). On disk
deepseek_v3 and glm4_moe_lite are written that way (mlx-lm's layout for them); mlx-lm's
deepseek_v2 keeps ``kv_b_proj``, so its folders are split when loaded. A quantized
``kv_b_proj`` is dequantized once there: the per-head matrices are small, and so stay float.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError
from ..model.config import ModelArgs
from .common import Architecture
from .decoders import llama_args
from .experts import GLM4_MOE_RENAMES, ROUTERS, glm4_moe_layout, moe_args

KV_B = "self_attn.kv_b_proj"


def latent_fields(config: dict) -> dict:
    """The MLA fields: ranks, the per-head widths, and the query/key head (nope + rope)
    as ``head_dim`` (so the softmax scale derives from it)."""
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    return {
        "kv_lora_rank": config["kv_lora_rank"],
        "q_lora_rank": config.get("q_lora_rank") or 0,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": config["v_head_dim"],
        "head_dim": nope + rope,
        # DeepSeek rotates adjacent pairs; transformers' rope_interleave=False the halves
        "rope_traditional": config.get("rope_interleave", True),
    }


def check_moe_layer_freq(config: dict) -> None:
    if config.get("moe_layer_freq", 1) != 1:
        raise UserError(f"moe_layer_freq {config['moe_layer_freq']} is not supported (only 1: every layer "
                        "after first_k_dense_replace has experts)")


def deepseek_v3_args(config: dict) -> dict:
    """Sigmoid routing with a learned choice bias over groups of experts (``noaux_tc``),
    ``n_shared_experts`` ungated shared experts, the first ``first_k_dense_replace`` dense."""
    check_moe_layer_freq(config)
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UserError(f"deepseek_v3 with topk_method {config['topk_method']!r} is not supported (noaux_tc)")
    return {**llama_args(config), **latent_fields(config), **sigmoid_moe(config)}


def sigmoid_moe(config: dict, **fields) -> dict:
    shared = config.get("n_shared_experts") or 0
    return moe_args(config, router_scoring="sigmoid", routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
                    n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1,
                    norm_topk_prob=config.get("norm_topk_prob", True),
                    shared_expert_intermediate_size=shared * config["moe_intermediate_size"],
                    first_k_dense_replace=config.get("first_k_dense_replace", 0), **fields)


def deepseek_v2_args(config: dict) -> dict:
    """Softmax routing, top k not renormalised (transformers' DeepseekV2TopkRouter ignores
    norm_topk_prob), times ``routed_scaling_factor``. ``group_limited_greedy`` is the same
    choice when every group stays eligible; a narrower one is refused."""
    check_moe_layer_freq(config)
    method = config.get("topk_method") or "greedy"
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    if method not in ("greedy", "group_limited_greedy") or (method == "group_limited_greedy" and topk_group < n_group):
        raise UserError(f"deepseek_v2 with topk_method {method!r} (topk_group {topk_group} of n_group {n_group}) "
                        "is not supported: only greedy routing")
    shared = config.get("n_shared_experts") or 0
    return {
        **llama_args(config),
        **latent_fields(config),
        "rope_traditional": True,  # V2 rotates complex pairs: adjacent dims
        **moe_args(config, router_scoring="softmax", norm_topk_prob=False,
                   routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
                   shared_expert_intermediate_size=shared * config["moe_intermediate_size"],
                   first_k_dense_replace=config.get("first_k_dense_replace", 0)),
    }


def glm4_moe_lite_args(config: dict) -> dict:
    """GLM-4.7-Flash: DeepSeek-V3's layer; which layers are dense is ``mlp_layer_types``
    ("dense" / "sparse"; default: only the first)."""
    n_layers = config["num_hidden_layers"]
    kinds = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
    dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    return {**llama_args(config), **latent_fields(config),
            **sigmoid_moe({**config, "first_k_dense_replace": 0}, mlp_only_layers=dense)}


def per_head_kv_b(weights: dict, n_heads: int, nope_dim: int, latent_dim: int) -> dict:
    """Every ``{attn}.kv_b_proj`` (H * (nope + v), R), float or quantized (dequantized
    here), -> ``{attn}.embed_q.weight`` (H, R, nope) and ``{attn}.unembed_out.weight``
    (H, v, R). Other tensors pass unchanged, so a split checkpoint passes as it is."""
    out = {}
    for name, tensor in weights.items():
        if f".{KV_B}." not in name:
            out[name] = tensor
        elif name.endswith(".weight"):
            prefix = name.removesuffix(".kv_b_proj.weight")
            like = weights[f"{prefix}.kv_a_layernorm.weight"].dtype  # the layer's float type (norms stay float)
            matrix = float_kv_b(weights, name.removesuffix(".weight"), latent_dim).astype(like)
            per_head = matrix.reshape(n_heads, -1, matrix.shape[-1])  # (H, nope + v, R)
            out[f"{prefix}.embed_q.weight"] = mx.contiguous(per_head[:, :nope_dim].swapaxes(-1, -2))
            out[f"{prefix}.unembed_out.weight"] = mx.contiguous(per_head[:, nope_dim:])
    return out


def float_kv_b(weights: dict, base: str, latent_dim: int) -> mx.array:
    """``base``.weight (out, latent_dim) as a float matrix; packed affine numbers are read
    with the bits and group size their shapes imply (as mlx-lm infers them), in float32
    (exact: the scales may be float16 where the model is float32, as GGUF's are)."""
    weight = weights[f"{base}.weight"]
    if f"{base}.scales" not in weights:
        return weight
    scales, biases = (weights[f"{base}.{kind}"].astype(mx.float32) for kind in ("scales", "biases"))
    bits, group_size = weight.shape[-1] * 32 // latent_dim, latent_dim // scales.shape[-1]
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)


def split_kv_b_on_disk(weights: dict, config: dict) -> dict:
    """deepseek_v3 / glm4_moe_lite: stacked experts, next-token-prediction layers dropped,
    ``kv_b_proj`` per head (mlx-lm's on-disk layout)."""
    weights = glm4_moe_layout(weights, config)
    return per_head_kv_b(weights, config["num_attention_heads"], config["qk_nope_head_dim"], config["kv_lora_rank"])


def split_kv_b_when_loaded(weights: dict, args: ModelArgs) -> dict:
    """deepseek_v2 keeps ``kv_b_proj`` on disk (mlx-lm's layout); we split it on loading."""
    return per_head_kv_b(weights, args.num_attention_heads, args.qk_nope_head_dim, args.kv_lora_rank)


# MLA families, by model_type. The routers stay float (router_bits None): mlx-lm's MoEGate
# is no linear layer and cannot read a quantized one.
LATENT: dict[str, Architecture] = {
    "deepseek_v2": Architecture(args=deepseek_v2_args, renames=GLM4_MOE_RENAMES, experts=glm4_moe_layout,
                                rewrite=split_kv_b_when_loaded, routers=ROUTERS, router_bits=None),
    "deepseek_v3": Architecture(args=deepseek_v3_args, renames=GLM4_MOE_RENAMES, experts=split_kv_b_on_disk,
                                routers=ROUTERS, router_bits=None),
    "glm4_moe_lite": Architecture(args=glm4_moe_lite_args, renames=GLM4_MOE_RENAMES, experts=split_kv_b_on_disk,
                                  routers=ROUTERS, router_bits=None),
}
