"""``load(path_or_repo) -> (model, tokenizer)`` in one pass down: find the folder (the hub,
or the converter for a foreign format), read its files, build the model from them
(``mlx_tfm.weights.build``: arguments and names by the family, the empty model,
quantized layers, filled strictly), specialize it for the device, then the tokenizer."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .cpu import specialize
from .errors import UserError
from .hub import resolve_model_path
from .model.config import ModelArgs
from .model.transformer import Model
from .weights.build import build_model
from .weights.files import has_safetensors, read_checkpoint
from .weights.sentence_modules import read_sentence_modules


def readable_folder(path: Path) -> Path:
    """llama2.c and GGUF files and PyTorch-only folders go through the converter first,
    into a temporary MLX folder; MLX and safetensors folders load as they are."""
    if has_safetensors(path):
        return path
    if path.is_dir() and not any(path.glob("pytorch_model*.bin")):
        raise UserError(f"{path} has no *.safetensors weights")
    from .convert.converter import (
        convert_to_temporary,  # an importer, only for foreign formats
    )

    return convert_to_temporary(path)


def load_model(folder: str | Path, dtype: mx.Dtype | None = None, shard=None) -> tuple[Model, dict]:
    """Build and fill the model of an MLX or Hugging Face safetensors folder, its layers
    specialized for the device (``mlx_tfm.cpu.specialize``). ``shard(model)`` (from
    ``mlx_tfm.distributed.sharding``) cuts the model to this rank's part while its weights
    are still unread, so only that part is read."""
    folder = readable_folder(Path(folder))
    config, weights = read_checkpoint(folder)
    model = build_model(config, weights, folder / "config.json", dtype)
    if model.args.kind == "encoder":  # its sentence-transformers pipeline, from files of its own
        model.sentence_modules = read_sentence_modules(folder, config)
    if shard is not None:
        shard(model)
    specialize(model)
    mx.eval(model.parameters())
    model.eval()
    return model, config


def load(path_or_repo: str | Path, adapter_path: str | Path | None = None, dtype: mx.Dtype | None = None,
         shard=None):
    """Load a model and its tokenizer from a folder or a Hugging Face repo id (``shard``:
    as for ``load_model``)."""
    from .tokenizer import load_tokenizer
    from .weights.catalog import record_used

    folder = readable_folder(resolve_model_path(path_or_repo))
    model, config = load_model(folder, dtype, shard)
    record_used(folder)  # `mlx-tfm list`'s "last used"
    if adapter_path is not None:
        from .weights.adapters import load_adapters

        load_adapters(model, adapter_path)
    tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    if model.args.vision is not None:  # an image-text model: its tokenizer prepares images too
        from .tokenizer.vision_processor import read_vision_processor

        tokenizer = read_vision_processor(folder, tokenizer, config) or tokenizer
    return model, tokenizer


__all__ = ["load", "load_model", "resolve_model_path", "ModelArgs"]
