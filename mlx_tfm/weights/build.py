"""A model from a checkpoint (its config and its tensors as they are on disk), in one pass
down: the family's table gives the ``ModelArgs`` and our tensor names, the math gives the
empty model, the quantization policy swaps in quantized layers where the checkpoint is
quantized, and the tensors fill it strictly: a missing, unexpected or mis-shaped tensor is
an error that names it. Each step is one function; ``build_model`` calls them in order
(``mlx_tfm.loading`` reads the folder before and specializes the model after)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UserError
from ..families import map_weights, model_args_from_config
from ..model.config import ModelArgs
from ..model.encoders import make_model
from ..model.transformer import Model
from .files import cast_weights
from .quantization import quantization_of, quantize_modules


def model_args(config: dict, source: Path | str) -> ModelArgs:
    """config.json -> ``ModelArgs``, by the family's table (or an error naming ``source``)."""
    try:
        return model_args_from_config(config)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"{source} does not describe a model we can build: {e}") from None


def empty_model(args: ModelArgs, source: Path | str) -> Model:
    """The model ``args`` describes (its kind: decoder, encoder or encoder-decoder), its
    random initialisation lazy (never computed)."""
    try:
        return make_model(args)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"{source} does not describe a model we can build: {e}") from None


def quantize_layers(model: nn.Module, config: dict, weights: dict, source: Path | str) -> None:
    """Quantized layers wherever the checkpoint (``weights``, in our names) carries
    quantized tensors; nothing for a float checkpoint. A scheme MLX cannot read (GPTQ,
    AWQ, ...) is refused by name."""
    quantization = quantization_of(config, source)
    if quantization:
        quantize_modules(model, quantization, weights)


def fill_strictly(model: nn.Module, weights: dict, dtype: mx.Dtype | None = None) -> None:
    """The model's parameters from ``weights`` (cast to ``dtype`` first, when given)."""
    load_weights_strictly(model, weights if dtype is None else cast_weights(weights, dtype))


def load_weights_strictly(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Every parameter present with its shape, nothing extra: or an error naming them."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise UserError(f"checkpoint is missing {len(missing)} tensor(s): {_names(missing)}")
    if unexpected:
        raise UserError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise UserError(
                f"shape mismatch for {name}: checkpoint {tuple(value.shape)}, model {tuple(expected[name].shape)}"
            )
    model.load_weights(list(weights.items()), strict=False)


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# Where an image-text model's tower and projector tensors are named (ours)
TOWER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "embed_vision.")


def without_tower(args: ModelArgs, named: dict) -> bool:
    """Whether ``named`` is an image-text checkpoint's language model without its tower
    (mlx-lm's conversions drop it, and some, Qwen3.5's, the vision_config too)."""
    if any(name.startswith(TOWER_PREFIXES) for name in named):
        return False
    return args.vision is not None or any(name.startswith("language_model.") for name in named)


def language_model_alone(args: ModelArgs, named: dict) -> tuple[ModelArgs, dict]:
    """An image-text checkpoint without its tower: the language model alone, its tensors
    under the text-only model's names."""
    return dataclasses.replace(args, vision=None), {name.removeprefix("language_model."): w for name, w in named.items()}


def build_model(config: dict, weights: dict, source: Path | str, dtype: mx.Dtype | None = None) -> Model:
    """The model ``config`` describes, filled strictly with ``weights`` (a checkpoint in its
    on-disk layout); quantized layers where the checkpoint has quantized tensors. Lazy:
    nothing is computed until the caller evaluates the parameters.

    The arguments come before the names because the family's rewrites split fused
    tensors by the head counts the arguments hold."""
    args = model_args(config, source)
    named = map_weights(config, args, weights)
    if without_tower(args, named):
        args, named = language_model_alone(args, named)
    model = empty_model(args, source)
    quantize_layers(model, config, named, source)
    fill_strictly(model, named, dtype)
    return model


__all__ = ["build_model", "model_args", "empty_model", "quantize_layers", "fill_strictly",
           "load_weights_strictly"]
