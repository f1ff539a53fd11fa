"""Weight I/O for model folders: the one safetensors reader, the one quantization policy,
strict loading into a model, and the one model-folder writer.

A model folder is ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``) and the tokenizer files. Everything that reads or writes
one goes through here: ``mlx_tfm.load``, the converter, training checkpoints and ``fuse``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .atomic import atomic_folder
from .errors import UserError
from .families import map_weights, model_args_from_config
from .encoders import make_model
from .model import Model, ModelArgs
from .tokenizer import TOKENIZER_FILES

SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # 5 GiB, as mlx-lm
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


# -- reading -----------------------------------------------------------------------------


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"{folder} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path} is not a JSON object")
    return config


def has_safetensors(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def sharded_files(folder: Path, index: Path) -> list[Path]:
    """The files a shard index names (every one must be there)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{index} is not a valid shard index ({e})") from None
    files = [folder / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{index.name} lists shard(s) that are missing: {', '.join(missing)}")
    return files


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: those its shard index names, else every *.safetensors."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return sharded_files(folder, index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no *.safetensors weights")
    return files


def read_safetensors(folder: Path) -> dict[str, mx.array]:
    """Every tensor of a folder's safetensors files (memory-mapped, lazy)."""
    weights = {}
    for file in safetensors_files(folder):
        try:
            weights.update(mx.load(str(file)))
        except Exception as e:  # mlx raises RuntimeError/ValueError for truncated or corrupt files
            raise UserError(f"{file} is not a readable safetensors file ({first_line(e)})") from None
    return weights


# -- the quantization policy -------------------------------------------------------------

# Quantization schemes of other runtimes, which MLX's affine layout cannot read.
FOREIGN_QUANTIZATION = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes", "fp8": "FP8",
                        "compressed-tensors": "compressed-tensors", "hqq": "HQQ", "eetq": "EETQ",
                        "aqlm": "AQLM", "exl2": "ExLlamaV2", "quanto": "Quanto", "torchao": "torchao"}


def quantization_of(config: dict, source: Path | str) -> dict | None:
    """MLX quantization settings of a config (``{"group_size", "bits", "mode"}`` plus any
    per-layer entries mlx-lm writes), None for a float model; any other scheme (GPTQ, AWQ,
    bitsandbytes...) is refused by name."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if not quantization:
        return None
    if "bits" in quantization and "group_size" in quantization and "quant_method" not in quantization:
        return {"mode": "affine", **quantization}
    method = str(quantization.get("quant_method") or quantization.get("mode") or "unknown")
    name = FOREIGN_QUANTIZATION.get(method.lower(), method)
    raise UserError(
        f"{source} is quantized with {name}, which mlx-tfm cannot read; use a float checkpoint "
        "(or an MLX-quantized one) and quantize it with mlx-tfm convert -q"
    )


def quantizable(name: str, tensor: mx.array, group_size: int) -> bool:
    """Linear and embedding matrices whose rows split into whole groups (as mlx-lm)."""
    return (
        name.endswith(".weight")
        and tensor.ndim == 2
        and mx.issubdtype(tensor.dtype, mx.floating)
        and tensor.shape[-1] % group_size == 0
    )


def quantize_weights(weights: dict, group_size: int, bits: int) -> dict:
    out = {}
    for name, tensor in weights.items():
        if quantizable(name, tensor, group_size):
            base = name.removesuffix(".weight")
            out[name], out[f"{base}.scales"], out[f"{base}.biases"] = mx.quantize(tensor, group_size, bits)
        else:
            out[name] = tensor
    return out


def dequantize_weights(weights: dict, quantization: dict, dtype: mx.Dtype | None = None) -> dict:
    """Every ``X.weight`` with ``X.scales``/``X.biases`` back to a float matrix of
    ``dtype`` (default: the scales' dtype). Computed in float32, so a float32 result is
    exact."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.scales" in weights:
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            tensor = mx.dequantize(
                tensor, scales.astype(mx.float32), biases.astype(mx.float32), quantization["group_size"],
                quantization["bits"],
            ).astype(dtype or scales.dtype)
        out[name] = tensor
    return out


def cast_weights(weights: dict, dtype: mx.Dtype) -> dict:
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


def dtype_name(weights: dict) -> str:
    """The dtype of the float tensors (the embedding's, which every model has)."""
    floats = [v.dtype for k, v in sorted(weights.items()) if mx.issubdtype(v.dtype, mx.floating)]
    names = {v: k for k, v in DTYPES.items()}
    return names.get(floats[0], "float32") if floats else "float32"


def quantize_modules(model: nn.Module, quantization: dict, weights: dict) -> None:
    """Swap in quantized layers wherever the checkpoint carries quantized tensors."""

    def is_quantized(path: str, module: nn.Module) -> bool:
        return f"{path}.scales" in weights

    nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                mode=quantization.get("mode", "affine"), class_predicate=is_quantized)


# -- into a model ------------------------------------------------------------------------


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


def model_args(config: dict, source: Path | str) -> ModelArgs:
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


def build_model(config: dict, weights: dict, source: Path | str, dtype: mx.Dtype | None = None) -> Model:
    """The model ``config`` describes, filled strictly with ``weights`` (a checkpoint in its
    on-disk layout); quantized layers where the checkpoint has quantized tensors. Lazy:
    nothing is computed until the caller evaluates the parameters."""
    args = model_args(config, source)
    quantization = quantization_of(config, source)
    mapped = map_weights(config, args, weights)
    model = empty_model(args, source)
    if quantization:
        quantize_modules(model, quantization, mapped)
    if dtype is not None:
        mapped = cast_weights(mapped, dtype)
    load_weights_strictly(model, mapped)
    return model


# -- writing -----------------------------------------------------------------------------


def shard(weights: dict, max_shard_bytes: int) -> list[dict]:
    """Names in sorted order, cut into groups of at most ``max_shard_bytes`` (a tensor
    larger than that gets a shard of its own)."""
    shards, current, size = [], {}, 0
    for name in sorted(weights):
        nbytes = weights[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = weights[name]
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def save_shard(path: Path, tensors: dict) -> None:
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})


def save_weights(folder: Path, weights: dict, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    shards = shard(weights, max_shard_bytes)
    if len(shards) == 1:
        save_shard(folder / "model.safetensors", shards[0])
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, tensors in zip(names, shards):
        save_shard(folder / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return names


def tokenizer_files_of(folder: Path) -> dict[str, bytes]:
    """The tokenizer (and generation) files a model folder has, name -> bytes."""
    return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}


def write_model_files(folder: Path, config: dict, weights: dict, files: dict[str, bytes],
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Weights, config.json and ``files`` (tokenizer files: name -> bytes) into an existing
    folder; returns the weight files' names."""
    names = save_weights(folder, weights, max_shard_bytes)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)  # sentence-transformers' module folders
        (folder / name).write_bytes(data)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return names


def save_model_folder(target: Path, config: dict, weights: dict, files: dict[str, bytes],
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, overwrite: bool = False,
                      extra: Callable[[Path], None] | None = None) -> list[str]:
    """A model folder written whole or not at all (a temporary folder renamed onto
    ``target``); ``extra(folder)`` may add more files before the rename."""
    with atomic_folder(target, overwrite=overwrite) as tmp:
        names = write_model_files(tmp, config, weights, files, max_shard_bytes)
        if extra is not None:
            extra(tmp)
    return names


__all__ = [
    "read_config", "read_safetensors", "quantization_of", "build_model", "load_weights_strictly",
    "save_model_folder", "write_model_files", "quantize_weights", "dequantize_weights",
]
