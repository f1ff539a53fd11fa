"""Hugging Face folders: safetensors (single or sharded), PyTorch ``.bin`` (read without
running pickled code), and MLX folders written by mlx-lm (quantized ones included)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from mlx_tfm.errors import UserError
from mlx_tfm.loading import read_config

from .checkpoint import Checkpoint

# Copied beside the weights when present: what a tokenizer and generation need.
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def read_hf_folder(folder: Path) -> Checkpoint:
    config = read_config(folder)
    quantization = mlx_quantization(config, folder)
    weights = read_folder_weights(folder)
    files = {name: (folder / name).read_bytes() for name in EXTRA_FILES if (folder / name).is_file()}
    return Checkpoint(config=config, weights=weights, files=files, quantization=quantization)


def mlx_quantization(config: dict, folder: Path) -> dict | None:
    """mlx-lm's {"group_size", "bits"}; other quantization schemes are refused by name."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if not quantization:
        return None
    if "bits" in quantization and "group_size" in quantization and quantization.get("mode", "affine") == "affine":
        return {"group_size": quantization["group_size"], "bits": quantization["bits"]}
    method = quantization.get("quant_method") or quantization.get("mode") or "unknown"
    raise UserError(f"{folder} is quantized with {method!r}; only float and MLX (affine) checkpoints can be converted")


def read_folder_weights(folder: Path) -> dict:
    # (shard index, file pattern, reader), safetensors first
    formats = (
        ("model.safetensors.index.json", "*.safetensors", read_safetensors_files),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin", read_torch_files),
    )
    for index_name, pattern, read in formats:
        index = folder / index_name
        if index.is_file():
            return read(sharded_files(folder, index))
        files = sorted(folder.glob(pattern))
        if files:
            return read(files)
    raise UserError(f"{folder} has no weights (*.safetensors or pytorch_model*.bin)")


def sharded_files(folder: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{index} is not a valid shard index ({e})") from None
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{index.name} lists shard(s) that are missing: {', '.join(missing)}")
    return files


def read_safetensors_files(files: list[Path]) -> dict:
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as e:  # mlx raises RuntimeError/ValueError for truncated or corrupt files
            raise UserError(f"{file} is not a readable safetensors file ({first_line(e)})") from None
    return weights


def read_torch_files(files: list[Path]) -> dict:
    try:
        import torch
    except ImportError:
        raise UserError(
            "reading PyTorch .bin checkpoints needs torch: pip install torch "
            "(or convert the checkpoint to safetensors first)"
        ) from None
    weights = {}
    for file in files:
        try:
            # weights_only: tensors and plain containers only, never pickled code.
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise UserError(f"{file} is not a readable PyTorch checkpoint ({first_line(e)})") from None
        for name, tensor in state.items():
            weights[name] = torch_to_mx(tensor)
    return weights


def torch_to_mx(tensor) -> mx.array:
    import torch

    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        return mx.array(tensor.float().numpy()).astype(mx.bfloat16)
    return mx.array(tensor.numpy())


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
