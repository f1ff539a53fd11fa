"""``mlx-tfm fuse``: fold trained adapters into the base weights and write a model folder."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..files import atomic_folder
from .checkpoints import TOKENIZER_FILES
from .lora import fuse_adapters, load_adapters


def fuse_model(model_path: str, adapter_path: str, save_path: str, dequantize: bool = False, overwrite: bool = True) -> Path:
    """Load base + adapters, fuse, and write config.json, model.safetensors and the
    tokenizer files to ``save_path`` (which ``mlx_tfm.load`` then reads)."""
    import shutil

    from ..loading import load_model, resolve_model_path

    source = resolve_model_path(model_path)
    model, config = load_model(source)
    load_adapters(model, adapter_path)
    fuse_adapters(model, dequantize=dequantize)
    if dequantize:
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    target = Path(save_path).expanduser()
    weights = dict(tree_flatten(model.parameters()))
    with atomic_folder(target, overwrite=overwrite) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
    return target
