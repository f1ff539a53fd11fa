"""Model folders on disk: the one reader (config.json, safetensors, honouring the shard
index) and the one writer (config, sharded safetensors, tokenizer files, written whole or
not at all).

A model folder is ``config.json``, ``model.safetensors`` (or shards with
``model.safetensors.index.json``) and the tokenizer files. Everything that reads or writes
one goes through here: ``mlx_tfm.load``, the converter, training checkpoints and ``fuse``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..atomic import atomic_folder
from ..errors import UserError, first_line
from ..jsonfile import read_json
from ..tokenizer import TOKENIZER_FILES

SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # 5 GiB, as mlx-lm
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def read_config(folder: Path) -> dict:
    return read_json(folder / "config.json", missing=f"{folder} has no config.json")


def has_safetensors(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def sharded_files(folder: Path, index: Path) -> list[Path]:
    """The files a shard index names (every one must be there)."""
    try:
        names = sorted(set(read_json(index)["weight_map"].values()))
    except (KeyError, TypeError, AttributeError) as e:
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


def read_checkpoint(folder: Path) -> tuple[dict, dict[str, mx.array]]:
    """A model folder's config.json and its tensors (lazy), as they are on disk."""
    return read_config(folder), read_safetensors(folder)


def cast_weights(weights: dict, dtype: mx.Dtype) -> dict:
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


def dtype_name(weights: dict) -> str:
    """The dtype of the float tensors (the embedding's, which every model has)."""
    floats = [v.dtype for k, v in sorted(weights.items()) if mx.issubdtype(v.dtype, mx.floating)]
    names = {v: k for k, v in DTYPES.items()}
    return names.get(floats[0], "float32") if floats else "float32"


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
