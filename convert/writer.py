"""Turning checked weights into an MLX folder: dtype, (de)quantization, sharded
safetensors, config and tokenizer files, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from mlx_tfm.files import atomic_folder

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # 5 GiB, as mlx-lm
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


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
                tensor, scales.astype(mx.float32), biases.astype(mx.float32), quantization["group_size"], quantization["bits"]
            ).astype(dtype or scales.dtype)
        out[name] = tensor
    return out


def cast_weights(weights: dict, dtype: mx.Dtype) -> dict:
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


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


def dtype_name(weights: dict) -> str:
    """The dtype of the float tensors (the embedding's, which every model has)."""
    floats = [v.dtype for k, v in sorted(weights.items()) if mx.issubdtype(v.dtype, mx.floating)]
    names = {v: k for k, v in DTYPES.items()}
    return names.get(floats[0], "float32") if floats else "float32"


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


def save_weights(folder: Path, weights: dict, max_shard_bytes: int) -> list[str]:
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
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return names


def write_folder(
    target: Path, config: dict, weights: dict, files: dict[str, bytes], max_shard_bytes: int, overwrite: bool
) -> list[str]:
    """Everything goes to a temporary folder renamed onto ``target`` at the end."""
    with atomic_folder(target, overwrite=overwrite) as tmp:
        names = save_weights(tmp, weights, max_shard_bytes)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes it private; a model folder is not
    return names


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
