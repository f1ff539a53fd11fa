"""State-space families: pure Mamba-2 and the hybrids that mix Mamba-2 layers with attention
(Granite 4, Nemotron-H, Falcon-H1): config -> ``ModelArgs`` fields, and their tensor names.

The Mamba-2 mixer is ``model/mamba.py`` (layer type "mamba"); these entries only say where
each family puts it. Hugging Face stores the mixers' ``conv1d.weight`` as PyTorch's
(conv_dim, 1, K); the on-disk layout (mlx-lm's) keeps MLX's (conv_dim, K, 1).
"""

from __future__ import annotations

import re

from ..errors import UserError
from ..model.config import ModelArgs
from .common import Architecture, split_rows


def mamba_fields(config: dict, heads: int, head_dim: int, inner: int, **fields) -> dict:
    """The ``mamba_*`` fields every family shares (``fields`` adds or overrides), checked:
    the heads must tile the inner width the family's config implies."""
    if heads * head_dim != inner:
        raise UserError(f"the Mamba heads ({heads} x {head_dim}) do not tile the inner width {inner}")
    return {
        "mamba_num_heads": heads,
        "mamba_head_dim": head_dim,
        "mamba_time_step_limit": time_step_limit(config),
        **fields,
    }


def json_float(value) -> float:
    """A number from config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def time_step_limit(config: dict) -> tuple[float, float]:
    low, high = config.get("time_step_limit") or (0.0, float("inf"))
    return json_float(low), json_float(high)


def conv_to_mlx_layout(weights: dict) -> dict:
    """PyTorch's depthwise ``*.conv1d.weight`` (C, 1, K) -> MLX's (C, K, 1); MLX's passes."""
    return {name: (t.swapaxes(1, 2) if name.endswith("conv1d.weight") and t.shape[-1] != 1 else t)
            for name, t in weights.items()}


def mamba2_args(config: dict) -> dict:
    """Pure Mamba-2: every block a pre-norm Mamba-2 mixer with its residual, no MLP."""
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UserError(f"mamba2 with hidden_act {config['hidden_act']!r} is not supported (silu only)")
    n_layers, D = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_heads"]
    return {
        "model_type": config["model_type"],
        "vocab_size": config["vocab_size"],
        "hidden_size": D,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 1,  # no attention layers
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "position_embedding": "none",
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "layer_types": ["mamba"] * n_layers,
        "block_sublayers": ["mixer"] * n_layers,
        **mamba_fields(config, heads, config["head_dim"], int(config.get("expand", 2) * D),
                       mamba_state_size=config["state_size"], mamba_n_groups=config.get("n_groups", 8),
                       mamba_conv_kernel=config.get("conv_kernel", 4), mamba_chunk_size=config.get("chunk_size", 256),
                       mamba_proj_bias=config.get("use_bias", False), mamba_out_proj_bias=config.get("use_bias", False),
                       mamba_conv_bias=config.get("use_conv_bias", True),
                       mamba_norm_eps=config.get("layer_norm_epsilon", 1e-5)),
    }


MAMBA2_RENAMES = (
    (r"backbone\.embeddings?\.(.*)", r"model.embed_tokens.\1"),  # older exports: backbone.embedding
    (r"backbone\.norm_f\.(.*)", r"model.norm.\1"),
    (r"backbone\.layers\.(\d+)\.norm\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"backbone\.layers\.(\d+)\.mixer\.(.*)", r"model.layers.\1.mamba.\2"),
)


def mamba2_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's mamba2 requires intermediate_size, and reads time_step_limit as two numbers."""
    return {"intermediate_size": int(config.get("expand", 2) * config["hidden_size"]),
            "time_step_limit": list(time_step_limit(config))}


# Config keys mlx-lm reads that transformers 5 writes differently or not at all (families/mlx_lm.py).
STATE_SPACE_MLX_LM_KEYS = {
    "mamba2": mamba2_mlx_lm_keys,
}

# State-space families, by model_type.
STATE_SPACE: dict[str, Architecture] = {
    "mamba2": Architecture(args=mamba2_args, renames=MAMBA2_RENAMES, layout=conv_to_mlx_layout),
}
