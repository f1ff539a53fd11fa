"""What the families' table entries share: the ``Architecture`` record, activation and
RoPE settings read from a config, fused tensors split by rows, and the tensors every
family drops."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ..errors import UserError
from ..model.config import ModelArgs

# Hugging Face activation names -> ours.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
    "quick_gelu": "quick_gelu",  # CLIP's vision towers
    "xielu": "xielu",  # Apertus: learned per layer (mlx_tfm/model/xielu.py)
}


def activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise UserError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rope_settings(config: dict) -> dict:
    """rope_theta, rope_scaling and partial_rotary_factor from either the classic keys or
    transformers 5's ``rope_parameters`` (which holds all of them, or one set per layer type:
    then the full-attention layers' set is the model's and the sliding layers' set gives
    ``rope_local_theta``)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        return {**flat_rope_settings({**config, "rope_parameters": params["full_attention"]}),
                **local_rope_settings(params.get("sliding_attention"))}
    return flat_rope_settings(config)


def local_rope_settings(params: dict | None) -> dict:
    if not params:
        return {}
    if params.get("rope_type", "default") != "default":
        raise UserError(f"sliding-window layers with {params['rope_type']!r} RoPE scaling are not supported")
    return {"rope_local_theta": params["rope_theta"]}


def flat_rope_settings(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor", 1.0)
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial}


def split_rows(weights: dict, fused: str, parts: dict[str, int]) -> dict:
    """Split every ``*.{fused}.{weight,bias,scales,biases}`` by rows into ``parts``
    (name -> number of output features). Quantized rows split like float ones."""
    pattern = re.compile(rf"(.*)\.{fused}\.(weight|bias|scales|biases)")
    total = sum(parts.values())
    out = {}
    for name, tensor in weights.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        if tensor.shape[0] != total:
            raise UserError(f"shape mismatch for {name}: {tensor.shape[0]} rows, expected {total}")
        start = 0
        for part, rows in parts.items():
            out[f"{prefix}.{part}.{kind}"] = tensor[start : start + rows]
            start += rows
    return out


# Names that are not weights of ours: precomputed RoPE tables some exports carry.
COMMON_DROPS = (r".*\.rotary_emb\.inv_freq",)
# The image side of image-text checkpoints: only the language model is loaded.
VISION_DROPS = (r"(model\.)?vision_tower\..*", r"(model\.)?multi_modal_projector\..*")


@dataclass(frozen=True)
class Architecture:
    args: Callable[[dict], dict]
    # (regex, replacement) pairs applied in order; a replacement of None drops the tensor.
    renames: tuple[tuple[str, str | None], ...] = ()
    drops: tuple[str, ...] = COMMON_DROPS
    # Optional whole-checkpoint rewrite for what a rename cannot say (fused tensors).
    rewrite: Callable[[dict, ModelArgs], dict] | None = field(default=None)
    # Optional Hugging Face layout -> on-disk (mlx-lm) layout; identity when None.
    layout: Callable[[dict], dict] | None = field(default=None)
    # Mixtures of experts: per-expert or fused Hugging Face experts -> stacked (weights, config).
    experts: Callable[[dict, dict], dict] | None = field(default=None)
    # On-disk module paths of the routers, which quantization keeps at ``router_bits`` (None:
    # float, where mlx-lm's router is no linear layer and cannot read a quantized one).
    routers: str | None = None
    router_bits: int | None = 8
    # On-disk module paths -q leaves in float unless asked (a vision tower and its projector)
    unquantized: str | None = None


def period_of(layer_types: list[str]) -> int:
    """The shortest repeat of a layer-type list (its length when it does not repeat)."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1) if all(layer_types[i] == layer_types[i % p] for i in range(n)))


def layer_type_rope_keys(config: dict) -> dict:
    """transformers 5's per-layer-type ``rope_parameters`` in the classic keys mlx-lm reads."""
    params = config.get("rope_parameters") or {}
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    keys = {}
    if "rope_theta" in full:
        keys["rope_theta"] = full["rope_theta"]
    if full.get("rope_type", "default") != "default":
        keys["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if "rope_theta" in sliding:
        keys["rope_local_base_freq"] = sliding["rope_theta"]
    return keys
