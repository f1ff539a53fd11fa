"""Llama 4 (text, and the language model of the image-text checkpoint): config ->
``ModelArgs`` fields, and its tensors -> the stacked-experts layout.

Llama 4 is Llama with: RoPE over adjacent pairs on most layers, each of them attending only
within its chunk of ``attention_chunk_size`` positions and normalising q and k (L2, no
weight); every ``no_rope_layer_interval``-th layer global, without positions, its queries
scaled up with the position (temperature tuning); a mixture of experts on every
``interleave_moe_layer_step``-th layer (``moe_layers``), whose sigmoid top-k router scales
the chosen experts' *input*, beside a shared expert.
"""

from __future__ import annotations

import re

import mlx.core as mx

from .common import COMMON_DROPS, VISION_DROPS, Architecture, flat_rope_settings
from .decoders import llama_args
from .experts import moe_args

# transformers' Llama4TextConfig defaults that hub configs may leave out.
LLAMA4_TEXT_DEFAULTS = {
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "rope_theta": 500000.0,
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "tie_word_embeddings": False,
}


def llama4_layer_plan(config: dict) -> tuple[list[bool], list[str], list[int]]:
    """Per layer: does it rotate, its attention kind; and the dense (non-MoE) layers."""
    n_layers = config["num_hidden_layers"]
    interval, step = config["no_rope_layer_interval"], config["interleave_moe_layer_step"]
    rotates = [bool(r) for r in (config.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(n_layers)])]
    moe_layers = config.get("moe_layers")
    moe_layers = list(range(step - 1, n_layers, step)) if moe_layers is None else moe_layers
    chunked = config.get("attention_chunk_size") is not None
    default_types = ["chunked_attention" if r and chunked else "full_attention" for r in rotates]
    layer_types = list(config.get("layer_types") or default_types)
    return rotates, layer_types, [i for i in range(n_layers) if i not in moe_layers]


def llama4_text_args(config: dict) -> dict:
    config = {**LLAMA4_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    rotates, layer_types, dense_layers = llama4_layer_plan(config)
    experts_size = config["intermediate_size"]
    return {
        **llama_args(config),
        "rope_traditional": True,  # complex multiplication of adjacent pairs
        "rope_layers": rotates,
        "layer_types": layer_types,
        "attention_chunk_size": config.get("attention_chunk_size"),
        "qk_l2_norm": bool(config["use_qk_norm"]),
        "attn_temperature_tuning": bool(config["attn_temperature_tuning"]),
        "floor_scale": float(config["floor_scale"]),
        "attn_scale": float(config["attn_scale"]),
        "intermediate_size": config["intermediate_size_mlp"],  # the dense layers' MLP
        **moe_args(config, moe_intermediate_size=experts_size, router_scoring="topk_sigmoid", router_scales_input=True,
                   shared_expert_intermediate_size=experts_size, mlp_only_layers=dense_layers),
    }


def llama4_args(config: dict) -> dict:
    """The language model of a Llama 4 image-text checkpoint (its ``text_config``)."""
    return {**llama4_text_args(config.get("text_config") or {}), "model_type": config["model_type"]}


LLAMA4_FUSED_EXPERTS = re.compile(r"(.*)\.feed_forward\.experts\.(gate_up_proj|down_proj)")


def llama4_experts(weights: dict, config: dict) -> dict:
    """transformers' experts, ``experts.gate_up_proj`` (experts, D, 2F), gate columns first,
    and ``experts.down_proj`` (experts, F, D), stored (in, out) -> one (experts, out, in)
    ``experts.{gate,up,down}_proj.weight`` each, as mlx-lm's llama4 stores them."""
    out = {}
    for name, tensor in weights.items():
        match = LLAMA4_FUSED_EXPERTS.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        block, fused = match.groups()
        experts = f"{block}.feed_forward.experts"
        if fused == "down_proj":
            out[f"{experts}.down_proj.weight"] = mx.swapaxes(tensor, 1, 2)  # (experts, D, F)
            continue
        F = tensor.shape[-1] // 2
        out[f"{experts}.gate_proj.weight"] = mx.swapaxes(tensor[..., :F], 1, 2)  # (experts, F, D)
        out[f"{experts}.up_proj.weight"] = mx.swapaxes(tensor[..., F:], 1, 2)
    return out


# On disk (mlx-lm's layout) the feed-forward is ``feed_forward.router`` / ``.experts`` /
# ``.shared_expert``, or the dense ``feed_forward.*_proj``; image-text checkpoints hold the
# text model under ``language_model.``.
LAYER = r"(?:language_model\.)?model\.layers\.(\d+)"
LLAMA4_RENAMES = (
    (rf"{LAYER}\.feed_forward\.experts\.(.*)", r"model.layers.\1.mlp.switch_mlp.\2"),
    (rf"{LAYER}\.feed_forward\.router\.(.*)", r"model.layers.\1.mlp.gate.\2"),
    (rf"{LAYER}\.feed_forward\.(.*)", r"model.layers.\1.mlp.\2"),
    (r"language_model\.model\.(.*)", r"model.\1"),
    (r"language_model\.lm_head\.(.*)", r"lm_head.\1"),
)
LLAMA4_DROPS = COMMON_DROPS + VISION_DROPS + (r"vision_model\..*",)
LLAMA4_ROUTERS = r"(language_model\.)?model\.layers\.\d+\.feed_forward\.router"

LLAMA4: dict[str, Architecture] = {
    "llama4_text": Architecture(args=llama4_text_args, renames=LLAMA4_RENAMES, experts=llama4_experts,
                                routers=LLAMA4_ROUTERS),
    "llama4": Architecture(args=llama4_args, renames=LLAMA4_RENAMES, drops=LLAMA4_DROPS, experts=llama4_experts,
                           routers=LLAMA4_ROUTERS),
}


def llama4_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's llama4 requires ``rope_theta`` and ``rope_scaling`` in ``text_config``, which
    transformers 5 keeps in ``rope_parameters`` only."""
    text = config.get("text_config") or {}
    rope = flat_rope_settings({**LLAMA4_TEXT_DEFAULTS, **text})
    return {"text_config": {**text, "rope_theta": rope["rope_theta"], "rope_scaling": rope["rope_scaling"]}}


# Config keys mlx-lm reads that transformers 5 writes differently (families/mlx_lm.py).
LLAMA4_MLX_LM_CONFIG_KEYS = {"llama4": llama4_mlx_lm_keys}
