"""Hugging Face folders: safetensors (single or sharded), PyTorch ``.bin`` (read without
running pickled code), and MLX folders written by mlx-lm (quantized ones included)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..errors import UserError, first_line
from ..weights.files import (
    has_safetensors,
    read_config,
    read_safetensors,
    sharded_files,
    tokenizer_files_of,
)
from ..weights.quantization import quantization_of
from ..weights.sentence_modules import sentence_files
from .sources import Source

TORCH_INDEX = "pytorch_model.bin.index.json"


def read_hf_folder(folder: Path) -> Source:
    config = read_config(folder)
    quantization = quantization_of(config, folder)
    weights = read_safetensors(folder) if has_safetensors(folder) else read_torch_folder(folder)
    files = {**tokenizer_files_of(folder), **sentence_module_files(folder)}
    return Source(config=config, weights=weights, files=files, quantization=quantization)


def sentence_module_files(folder: Path) -> dict[str, bytes]:
    """sentence-transformers' module files, carried as they are; a module's PyTorch-only
    weights (an older 2_Dense/pytorch_model.bin) become its model.safetensors."""
    files = sentence_files(folder)
    for name in [n for n in files if n.endswith("/pytorch_model.bin")]:
        converted = name.rsplit("/", 1)[0] + "/model.safetensors"
        del files[name]
        if converted not in files:
            files[converted] = safetensors_bytes(read_torch_files([folder / name]))
    return files


def safetensors_bytes(tensors: dict) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        mx.save_safetensors(str(path), tensors)
        return path.read_bytes()


def read_torch_folder(folder: Path) -> dict:
    """The weights of a folder holding only PyTorch ``pytorch_model*.bin`` files."""
    index = folder / TORCH_INDEX
    files = sharded_files(folder, index) if index.is_file() else sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise UserError(f"{folder} has no weights (*.safetensors or pytorch_model*.bin)")
    return read_torch_files(files)


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
