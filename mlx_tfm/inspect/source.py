"""The model being inspected: loaded as ``mlx_tfm.load`` loads it (so it refuses what load
refuses, with the same message), and the files it came from.

On disk: a safetensors folder's tensors are read lazily (nothing is loaded) and mapped
onto the model's parts with the family's own rename table, so each part gets the bytes it
takes on disk; what is on disk but in no part (a tied head's copy, RoPE tables some
exports carry, GPT-2's mask buffers) is counted apart. A llama2.c or GGUF file (or
PyTorch ``.bin`` files) goes through the converter: its size is known, not its parts'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..families import map_weights
from ..hub import resolve_model_path
from ..loading import load_model, readable_folder
from ..model.config import ModelArgs
from ..model.transformer import Model
from ..weights.files import has_safetensors, read_safetensors, safetensors_files
from .parts import Part


@dataclass
class Inspected:
    """A loaded model and where it came from."""

    source: Path  # the folder or file the user named (a hub id resolved to its local snapshot)
    folder: Path  # the safetensors folder it was read from (a temporary one for a foreign format)
    model: Model
    config: dict

    def tokenizer(self):
        from ..tokenizer import load_tokenizer

        return load_tokenizer(self.folder, eos_token_ids=self.config.get("eos_token_id"))


def open_model(path_or_repo: str | Path) -> Inspected:
    """Resolve, convert when the format needs it, and load strictly: ``mlx_tfm.load``'s steps."""
    source = resolve_model_path(path_or_repo)
    folder = readable_folder(source)
    model, config = load_model(folder)
    return Inspected(source, folder, model, config)


@dataclass(frozen=True)
class Disk:
    files: list[tuple[str, int]]  # the weight files and their sizes in bytes
    tensor_bytes: int | None  # the tensors in them (None: a format read through the converter)
    by_part: dict[str, int] = field(default_factory=dict)  # module path -> bytes of its tensors on disk
    not_loaded: int | None = None  # tensor bytes on disk that belong to no part

    @property
    def file_bytes(self) -> int:
        return sum(size for _, size in self.files)


def weight_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if has_safetensors(source):
        return safetensors_files(source)
    return sorted(source.glob("pytorch_model*.bin"))


def disk_usage(source: Path, config: dict, args: ModelArgs, parts: list[Part]) -> Disk:
    """The weight files' sizes and, for a safetensors folder, each part's bytes on disk."""
    files = [(str(f), f.stat().st_size) for f in weight_files(source)]
    if not has_safetensors(source):
        return Disk(files, tensor_bytes=None)
    stored = read_safetensors(source)  # lazy: only shapes and dtypes are read
    by_part: dict[str, int] = {}
    for name, tensor in map_weights(config, args, stored).items():
        path = name.rpartition(".")[0]
        by_part[path] = by_part.get(path, 0) + tensor.nbytes
    names = {part.name for part in parts}
    by_part = {path: size for path, size in by_part.items() if path in names}
    tensor_bytes = sum(tensor.nbytes for tensor in stored.values())
    return Disk(files, tensor_bytes, by_part, tensor_bytes - sum(by_part.values()))


__all__ = ["Inspected", "open_model", "Disk", "disk_usage"]
