"""Config keys mlx-lm reads that transformers 5 writes differently or not at all: the
converter adds them to the config.json it writes, so mlx-lm loads our folders."""

from __future__ import annotations

from typing import Callable

from .common import layer_type_rope_keys, period_of
from .convolutions import lfm2_mlx_lm_keys
from .decoders import GEMMA3_TEXT_DEFAULTS
from .gemma4 import GEMMA4_TEXT_DEFAULTS, gemma4_layer_types, global_layer_shape
from .kimi import kimi_mlx_lm_keys
from .llama4 import LLAMA4_MLX_LM_CONFIG_KEYS
from .mlx_vlm import MLX_VLM_CONFIG_KEYS, gemma3_mlx_vlm_keys
from .qwen_vl import QWEN_VL_MLX_LM_KEYS
from .state_space import STATE_SPACE_MLX_LM_KEYS

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


def gpt_neox_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's gpt_neox requires transformers 4's ``rotary_emb_base`` and ``rotary_pct``."""
    params = config.get("rope_parameters") or {}
    return {"rotary_emb_base": config.get("rotary_emb_base", params.get("rope_theta", 10000.0)),
            "rotary_pct": config.get("rotary_pct", params.get("partial_rotary_factor", 0.25))}


# Keys whose default in mlx-lm's gemma4_text differs from transformers' (a hub config may
# leave them out): transformers' value, when the config has none.
GEMMA4_MLX_LM_DEFAULTS = {"num_kv_shared_layers": 0, "use_double_wide_mlp": False, "final_logit_softcapping": None,
                          "num_key_value_heads": GEMMA4_TEXT_DEFAULTS["num_key_value_heads"],
                          "hidden_size": GEMMA4_TEXT_DEFAULTS["hidden_size"],
                          "num_hidden_layers": GEMMA4_TEXT_DEFAULTS["num_hidden_layers"],
                          "intermediate_size": GEMMA4_TEXT_DEFAULTS["intermediate_size"]}


def gemma4_text_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's gemma4_text reads the full layers' head size and KV heads from
    ``global_head_dim`` and ``num_global_key_value_heads``, which transformers 5 writes as
    ``per_layer_config``, and has defaults of its own for some keys."""
    restated = {k: config.get(k, default) for k, default in GEMMA4_MLX_LM_DEFAULTS.items()}
    config = {**GEMMA4_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    layer_types = gemma4_layer_types(config)
    shape = global_layer_shape(config, layer_types)
    return {**restated, "layer_types": layer_types, "global_head_dim": shape["global_head_dim"] or config["head_dim"],
            "num_global_key_value_heads": shape["num_global_key_value_heads"] or None}


def gemma4_mlx_lm_keys(config: dict) -> dict:
    text = config.get("text_config") or {}
    vocab_size = text.get("vocab_size", GEMMA4_TEXT_DEFAULTS["vocab_size"])  # mlx-lm's gemma4 hands its own down
    return {"vocab_size": vocab_size, "text_config": {**text, **gemma4_text_mlx_lm_keys(text)}}


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
    "gemma3": lambda config: {**gemma3_mlx_lm_keys(config), **gemma3_mlx_vlm_keys(config)},  # mlx_vlm.py
    "olmo3": layer_type_rope_keys,
    "exaone4": exaone4_mlx_lm_keys,
    "glm4_moe": lambda config: {"rope_scaling": None},  # a required field of mlx-lm's glm4_moe
    **STATE_SPACE_MLX_LM_KEYS,
    "lfm2": lfm2_mlx_lm_keys,
    **LLAMA4_MLX_LM_CONFIG_KEYS,
    "cohere2": gemma3_text_mlx_lm_keys,  # mlx-lm's cohere2 reads sliding_window_pattern too
    "gpt_neox": gpt_neox_mlx_lm_keys,
    # required fields of mlx-lm's apertus that transformers' config has no key for
    "apertus": lambda config: {"mlp_bias": config.get("mlp_bias", False), "post_norm": False, "qk_norm": True},
    "gemma4_text": gemma4_text_mlx_lm_keys,
    "gemma4": gemma4_mlx_lm_keys,
    # mlx-lm's mistral3 ties the head by text_config's key, transformers by the top-level one
    "mistral3": lambda config: {"text_config": {**config["text_config"],
                                                "tie_word_embeddings": config.get("tie_word_embeddings", True)}},
    "hunyuan_v1_dense": lambda config: {"rope_scaling": hunyuan_rope_scaling(config)},
    "minimax_m2": minimax_m2_mlx_lm_keys,
    **QWEN_VL_MLX_LM_KEYS,  # qwen_vl.py
    **MLX_VLM_CONFIG_KEYS,  # mlx_vlm.py: what mlx-vlm reads of idefics3 / smolvlm / llava_next
    "kimi_linear": kimi_mlx_lm_keys,
    "exaone_moe": lambda config: {  # required fields of mlx-lm's exaone_moe
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "is_moe_layer": [t == "sparse" for t in config.get("mlp_layer_types") or []],
    },
}


def mlx_lm_config_keys(config: dict) -> dict:
    """Keys to set in a config.json we write so that mlx-lm reads it as we do (each only
    restates what the config already says, in the spelling mlx-lm reads)."""
    return MLX_LM_CONFIG_KEYS.get(config.get("model_type"), lambda _: {})(config)
