"""How each Hugging Face ``model_type`` maps onto the one model: a declarative table.

An entry says which ``ModelArgs`` fields the checkpoint's config.json implies, and how its
tensor names map onto ours (``None`` drops a tensor). Everything else is shared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from mlx_tfm.errors import UserError
from mlx_tfm.model import ModelArgs


def rope_settings(config: dict) -> dict:
    """rope_theta and rope_scaling from either the classic keys or transformers 5's
    ``rope_parameters`` (which holds both)."""
    params = dict(config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return {"rope_theta": theta, "rope_scaling": scaling}


def llama_args(config: dict) -> dict:
    return {
        **config,
        **rope_settings(config),
        "norm_type": "rmsnorm",
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "hidden_act": config.get("hidden_act", "silu"),
        "attention_out_bias": config.get("attention_bias", False),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


# Names that are not weights of ours: precomputed RoPE tables some exports carry.
COMMON_DROPS = (r".*\.rotary_emb\.inv_freq",)


@dataclass(frozen=True)
class Architecture:
    args: Callable[[dict], dict]
    # (regex, replacement) pairs applied in order; a replacement of None drops the tensor.
    renames: tuple[tuple[str, str | None], ...] = ()
    drops: tuple[str, ...] = COMMON_DROPS
    # Optional whole-checkpoint rewrite for what a rename cannot say (fused tensors, transposes).
    rewrite: Callable[[dict, ModelArgs], dict] | None = field(default=None)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(args=llama_args),
    "mistral": Architecture(args=llama_args),
}


def architecture_for(config: dict) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UserError(f"unknown model_type {model_type!r}; supported: {supported}")
    return ARCHITECTURES[model_type]


def model_args_from_config(config: dict) -> ModelArgs:
    """config.json (Hugging Face or mlx-lm) -> ModelArgs."""
    return ModelArgs.from_dict(architecture_for(config).args(config))


def map_weights(config: dict, args: ModelArgs, weights: dict) -> dict:
    """Rename, drop and rewrite a checkpoint's tensors into our names. Idempotent, so
    folders we wrote ourselves pass through unchanged."""
    arch = architecture_for(config)
    drops = [re.compile(p) for p in arch.drops]
    mapped = {}
    for name, tensor in weights.items():
        if any(p.fullmatch(name) for p in drops):
            continue
        for pattern, replacement in arch.renames:
            if re.fullmatch(pattern, name):
                name = None if replacement is None else re.sub(pattern, replacement, name)
                break
        if name is not None:
            mapped[name] = tensor
    if args.tie_word_embeddings:
        mapped.pop("lm_head.weight", None)
    if arch.rewrite is not None:
        mapped = arch.rewrite(mapped, args)
    return mapped
