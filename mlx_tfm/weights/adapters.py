"""Adapters on disk, in mlx-lm's files: ``adapters.safetensors`` (only the trainable
weights) and ``adapter_config.json`` (fine-tune type, layers, rank, scale, dropout). They
load through the same surgery that trained them (``mlx_tfm.model.lora``), strictly."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..atomic import atomic_file
from ..errors import UserError
from ..jsonfile import read_json
from ..model.lora import FINE_TUNE_TYPES, LORA_DEFAULTS, apply_lora

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_config(fine_tune_type: str, num_layers: int, lora_parameters: dict, **extra) -> dict:
    """The adapter_config.json mlx-lm writes and reads (it keeps the training arguments)."""
    return {"fine_tune_type": fine_tune_type, "num_layers": num_layers, "lora_parameters": lora_parameters, **extra}


def save_adapters(folder: str | Path, model: nn.Module, config: dict) -> None:
    """Write the trainable weights and the config that rebuilds them, each atomically."""
    folder = Path(folder)
    weights = dict(tree_flatten(model.trainable_parameters()))
    with atomic_file(folder / ADAPTER_WEIGHTS) as tmp:
        mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    with atomic_file(folder / ADAPTER_CONFIG) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(folder: Path) -> dict:
    path = folder / ADAPTER_CONFIG
    config = read_json(path, missing=f"adapter path {folder} has no {ADAPTER_CONFIG}")
    if config.get("fine_tune_type", "lora") not in FINE_TUNE_TYPES:
        raise UserError(f"{path}: unknown fine_tune_type {config.get('fine_tune_type')!r}")
    return config


def load_adapter_weights(model: nn.Module, weights_path: Path) -> None:
    """Load adapter weights onto an already-adapted model; every name must exist with its shape."""
    if not weights_path.is_file():
        raise UserError(f"adapter weights {weights_path} not found")
    try:
        weights = mx.load(str(weights_path))
    except Exception as e:
        raise UserError(f"{weights_path} is not a readable safetensors file ({e})") from None
    expected = dict(tree_flatten(model.parameters()))
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise UserError(f"{weights_path} has {len(unknown)} tensor(s) the model lacks, e.g. {unknown[0]}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise UserError(f"{weights_path}: shape mismatch for {name}: {tuple(value.shape)} vs {tuple(expected[name].shape)}")
    model.load_weights(list(weights.items()), strict=False)


def load_adapters(model: nn.Module, adapter_path: str | Path) -> nn.Module:
    """Rebuild the adapters described by ``adapter_config.json`` and load their weights."""
    folder = Path(adapter_path).expanduser()
    if not folder.is_dir():
        raise UserError(f"adapter path {folder} is not a folder")
    config = read_adapter_config(folder)
    params = {**LORA_DEFAULTS, **(config.get("lora_parameters") or {})}
    apply_lora(
        model,
        num_layers=config.get("num_layers", 16),
        fine_tune_type=config.get("fine_tune_type", "lora"),
        rank=params["rank"],
        scale=params["scale"],
        dropout=params["dropout"],
        keys=params.get("keys"),
    )
    load_adapter_weights(model, folder / ADAPTER_WEIGHTS)
    mx.eval(model.parameters())
    model.eval()
    return model
