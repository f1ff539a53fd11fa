"""A model read from any source format, before it is written as an MLX folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError


@dataclass
class Source:
    """What every reader returns.

    config: a Hugging Face config.json dict (with ``model_type``).
    weights: tensor name -> mx.array, in the source's Hugging Face naming.
    files: tokenizer (and generation) files to write beside the weights, name -> bytes.
    quantization: {"group_size", "bits", "mode"} when some weights are MLX-quantized
      (``X.weight`` packed uint32 with ``X.scales`` and ``X.biases``), else None.
    """

    config: dict
    weights: dict
    files: dict[str, bytes] = field(default_factory=dict)
    quantization: dict | None = None


GGUF_MAGIC = b"GGUF"


def read_source(path: Path) -> Source:
    """Dispatch on what ``path`` is: a folder (Hugging Face or MLX), or a file told apart by
    its first bytes (GGUF magic; otherwise a llama2.c checkpoint, whose legacy header has
    no magic)."""
    if path.is_dir():
        from .hf import read_hf_folder

        return read_hf_folder(path)
    with open(path, "rb") as f:
        magic = f.read(9)
    if magic[8:9] == b"{":  # safetensors: an 8-byte header length, then its JSON header
        raise UserError(f"{path} is a safetensors file: pass the folder that holds it and its config.json")
    if magic[:4] == GGUF_MAGIC:
        from .gguf_file import read_gguf

        return read_gguf(path)
    from .llama2c import read_llama2c

    return read_llama2c(path)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)
