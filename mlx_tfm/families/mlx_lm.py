"""Config keys mlx-lm reads that transformers 5 writes differently or not at all: the
converter adds them to the config.json it writes, so mlx-lm loads our folders."""

from __future__ import annotations

from typing import Callable

from .common import layer_type_rope_keys, period_of
from .decoders import GEMMA3_TEXT_DEFAULTS

# Config keys mlx-lm requires that transformers 5 no longer writes: key -> the key it equals.
MLX_LM_CONFIG_ALIASES = {
    "gpt2": {"n_ctx": "n_positions"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "internlm3": {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
    "exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps"},  # the hub's spelling, which mlx-lm reads
}


def gemma3_text_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's gemma3_text reads ``sliding_window_pattern`` (every n-th layer global), not
    ``layer_types``; written when the layer types follow that pattern."""
    keys = layer_type_rope_keys(config)
    layer_types = config.get("layer_types") or []
    if layer_types:
        n = period_of(layer_types)
        every_nth = ["sliding_attention"] * (n - 1) + ["full_attention"]
        if layer_types[:n] == every_nth:
            keys["sliding_window_pattern"] = n
    return keys


def gemma3_mlx_lm_keys(config: dict) -> dict:
    text = config.get("text_config") or {}
    vocab_size = config.get("vocab_size") or text.get("vocab_size", GEMMA3_TEXT_DEFAULTS["vocab_size"])
    return {"vocab_size": vocab_size, "text_config": {**text, **gemma3_text_mlx_lm_keys(text)}}


def exaone4_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's exaone4 needs head_dim and rope_scaling, and the window pattern as letters
    ("LLLG": L local, G global)."""
    keys = {"head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "rope_scaling": config.get("rope_scaling")}
    layer_types = config.get("layer_types") or []
    if config.get("sliding_window") and layer_types and not isinstance(config.get("sliding_window_pattern"), str):
        period = layer_types[: period_of(layer_types)]
        keys["sliding_window_pattern"] = "".join("L" if t == "sliding_attention" else "G" for t in period)
    return keys


def hunyuan_rope_scaling(config: dict) -> dict | None:
    """mlx-lm's hunyuan_v1_dense wants rope_scaling with alpha, factor and ``type``."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not scaling.get("alpha"):
        return None
    return {"alpha": scaling["alpha"], "factor": scaling.get("factor", 1.0), "type": "dynamic"}


def minimax_m2_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's minimax (which runs minimax_m2) requires rotary_dim, and the size of a shared
    expert M2 does not have (0, as its hub configs say)."""
    partial = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return {"rotary_dim": config.get("rotary_dim") or int(config["head_dim"] * partial),
            "shared_intermediate_size": config.get("shared_intermediate_size", 0)}


# Config keys mlx-lm reads that transformers 5 writes differently or not at all, by model_type.
MLX_LM_CONFIG_KEYS: dict[str, Callable[[dict], dict]] = {
    "gemma3_text": gemma3_text_mlx_lm_keys,
    "gemma3": gemma3_mlx_lm_keys,
    "olmo3": layer_type_rope_keys,
    "exaone4": exaone4_mlx_lm_keys,
    "glm4_moe": lambda config: {"rope_scaling": None},  # a required field of mlx-lm's glm4_moe
    # mlx-lm's mistral3 ties the head by text_config's key, transformers by the top-level one
    "mistral3": lambda config: {"text_config": {**config["text_config"],
                                                "tie_word_embeddings": config.get("tie_word_embeddings", True)}},
    "hunyuan_v1_dense": lambda config: {"rope_scaling": hunyuan_rope_scaling(config)},
    "minimax_m2": minimax_m2_mlx_lm_keys,
    "exaone_moe": lambda config: {  # required fields of mlx-lm's exaone_moe
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "is_moe_layer": [t == "sparse" for t in config.get("mlp_layer_types") or []],
    },
}


def mlx_lm_config_keys(config: dict) -> dict:
    """Keys to set in a config.json we write so that mlx-lm reads it as we do (each only
    restates what the config already says, in the spelling mlx-lm reads)."""
    return MLX_LM_CONFIG_KEYS.get(config.get("model_type"), lambda _: {})(config)
