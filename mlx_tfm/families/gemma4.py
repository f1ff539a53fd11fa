"""Gemma 4 (``gemma4_text``, and ``gemma4``: the language model of the image-audio-text
checkpoint): Gemma 3's sandwich norms and q/k norms, plus values RMS-normed, scores
unscaled, full-attention layers with their own head size (and, with keys as values,
their own KV heads) rotating "proportionally", per-layer inputs, KV sharing across the
last layers and a learned scalar per block. Each is a ``ModelArgs`` field."""

from __future__ import annotations

import re

from ..errors import UserError
from ..model.config import ModelArgs
from .common import COMMON_DROPS, VISION_DROPS, Architecture, local_rope_settings
from .decoders import GEMMA3_RENAMES, gemma3_layout, gemma_args

# transformers' Gemma4TextConfig defaults, for the keys a hub config may leave out.
GEMMA4_TEXT_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
}
GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's global_head_dim when a config gives none


def gemma4_layer_types(config: dict) -> list[str]:
    """Five sliding layers to one full, unless given; the last layer is always full."""
    n_layers = config["num_hidden_layers"]
    types = list(config.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)])
    types[-1] = "full_attention"
    return types


def global_layer_shape(config: dict, layer_types: list[str]) -> dict:
    """The full-attention layers' head size and KV heads: transformers 5 saves them as
    ``per_layer_config`` (layer index -> overrides), older configs as ``global_head_dim``
    and ``num_global_key_value_heads`` (the latter only with keys as values)."""
    overrides = config.get("per_layer_config")
    if overrides is None:
        kv_heads = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
        return {"global_head_dim": config.get("global_head_dim") or GLOBAL_HEAD_DIM,
                "num_global_key_value_heads": kv_heads or 0}
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    overrides = {int(k): v for k, v in overrides.items()}  # keys zero-padded ("05") past 9 layers
    shapes = {str(i): overrides.get(i, {}) for i in range(len(layer_types))}
    if any(shapes[str(i)] for i in range(len(layer_types)) if i not in full):
        raise UserError("gemma4 per_layer_config overrides a sliding layer; only full-attention layers may differ")
    if len({tuple(sorted(shapes[str(i)].items())) for i in full}) > 1:
        raise UserError("gemma4 per_layer_config gives the full-attention layers different shapes")
    shape = shapes[str(full[0])] if full else {}
    return {"global_head_dim": shape.get("head_dim", 0), "num_global_key_value_heads": shape.get("num_key_value_heads", 0)}


def gemma4_rope(config: dict) -> dict:
    """Full layers: their base and scaling ("proportional" keeps its partial_rotary_factor,
    over the whole head); sliding layers: their own base, unscaled."""
    params = config["rope_parameters"]
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    theta = full.pop("rope_theta", 1_000_000.0)
    scaling = full if full.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": 1.0,
            **local_rope_settings(params.get("sliding_attention"))}


def check_supported(config: dict) -> None:
    if config.get("use_bidirectional_attention"):
        raise UserError("gemma4 with use_bidirectional_attention is not supported")
    if config.get("num_kv_shared_layers", 0) >= config["num_hidden_layers"]:
        raise UserError("gemma4 with every layer KV-shared has no layer to share keys and values from")


def gemma4_text_args(config: dict) -> dict:
    config = {**GEMMA4_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    check_supported(config)
    layer_types = gemma4_layer_types(config)
    return {
        **gemma_args(config),
        **gemma4_rope(config),
        **global_layer_shape(config, layer_types),
        "norm_weight_offset": 0.0,  # Gemma 4's norms scale by their weight, not 1 + weight
        "norm_placement": "sandwich",
        "qk_norm": True,
        "value_norm": True,
        "attention_scale": 1.0,  # the q/k norms stand in for 1/sqrt(head_dim)
        "sliding_window": config["sliding_window"],
        "layer_types": layer_types,
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "attention_k_eq_v": bool(config.get("attention_k_eq_v")),
        "num_kv_shared_layers": config.get("num_kv_shared_layers", 0),
        "double_wide_mlp": bool(config.get("use_double_wide_mlp")),
        "hidden_size_per_layer_input": config["hidden_size_per_layer_input"] or 0,
        "vocab_size_per_layer_input": config["vocab_size_per_layer_input"],
        "layer_scalar": True,
        **beside_experts(config),
    }


def beside_experts(config: dict) -> dict:
    """Gemma 4's mixture of experts: routed experts beside every dense FFN (not in place
    of it, so ``num_experts``, which would replace the FFN, stays 0)."""
    if not config.get("enable_moe_block"):
        return {"num_experts": 0}
    n_experts, per_token = config.get("num_experts") or 0, config.get("top_k_experts") or 0
    if not 0 < per_token <= n_experts:
        raise UserError(f"gemma4 with enable_moe_block needs 1 <= top_k_experts ({per_token}) <= num_experts ({n_experts})")
    return {"num_experts": 0, "experts_beside_mlp": n_experts, "num_experts_per_tok": per_token,
            "moe_intermediate_size": config["moe_intermediate_size"]}


def gemma4_args(config: dict) -> dict:
    """The language model of a Gemma 4 image-audio-text checkpoint (its ``text_config``)."""
    return {**gemma4_text_args(config.get("text_config") or {}), "model_type": config["model_type"]}


SHARED_LAYER_KV = re.compile(r"(.*\.)?layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\..*")


def drop_shared_layers_kv(weights: dict, args: ModelArgs) -> dict:
    """KV-shared layers have no key/value projections of their own; checkpoints that
    carry them anyway (unused) lose them here."""
    first = args.num_hidden_layers - args.num_kv_shared_layers

    def unused(name: str) -> bool:
        match = SHARED_LAYER_KV.fullmatch(name)
        return match is not None and int(match.group(2)) >= first

    return {name: tensor for name, tensor in weights.items() if not unused(name)}


FUSED_EXPERTS = re.compile(r"(.*\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)")


def experts_layout(weights: dict, config: dict) -> dict:
    """transformers' stacked experts (``experts.gate_up_proj`` (E, 2F, D), gate rows first;
    ``experts.down_proj`` (E, D, F)) -> mlx-lm's ``experts.switch_glu.{gate,up,down}_proj``."""
    out = {}
    for name, tensor in weights.items():
        match = FUSED_EXPERTS.fullmatch(name)
        if match is None:
            out[name] = tensor
        elif match.group(2) == "down_proj":
            out[f"{match.group(1)}.switch_glu.down_proj.weight"] = tensor
        else:
            F = tensor.shape[1] // 2
            out[f"{match.group(1)}.switch_glu.gate_proj.weight"] = tensor[:, :F]
            out[f"{match.group(1)}.switch_glu.up_proj.weight"] = tensor[:, F:]
    return out


# mlx-lm keeps the routers at 8 bits when it quantizes (its gemma4_text quant_predicate).
ROUTERS = r"(language_model\.)?model\.layers\.\d+\.router\.proj"

# The image and audio sides of the multimodal checkpoint: only the language model loads.
AUDIO_DROPS = (r"(model\.)?audio_tower\..*", r"(model\.)?embed_audio\..*", r"(model\.)?embed_vision\..*")

GEMMA4: dict[str, Architecture] = {
    "gemma4_text": Architecture(args=gemma4_text_args, rewrite=drop_shared_layers_kv, experts=experts_layout,
                                routers=ROUTERS),
    "gemma4": Architecture(args=gemma4_args, renames=GEMMA3_RENAMES, drops=COMMON_DROPS + VISION_DROPS + AUDIO_DROPS,
                           layout=gemma3_layout, rewrite=drop_shared_layers_kv, experts=experts_layout,
                           routers=ROUTERS),
}
