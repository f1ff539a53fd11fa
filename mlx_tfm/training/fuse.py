"""``mlx-tfm fuse``: fold trained adapters into the base weights and write a model folder."""

from __future__ import annotations

import sys
from pathlib import Path

from mlx.utils import tree_flatten

from ..atomic import remove_stale_temporaries
from ..errors import UserError
from ..hub import resolve_model_path
from ..model.lora import fuse_adapters
from ..weights.adapters import load_adapters
from ..weights.files import save_model_folder, tokenizer_files_of


def fuse_model(model_path: str, adapter_path: str, save_path: str, dequantize: bool = False, overwrite: bool = False,
               log=lambda text: print(text, file=sys.stderr)) -> Path:
    """Load base + adapters, fuse, and write config.json, model.safetensors and the
    tokenizer files to ``save_path`` (which ``mlx_tfm.load`` then reads). An existing
    ``save_path`` is refused before anything is loaded, unless ``overwrite`` (as convert)."""
    from ..loading import load_model

    target = Path(save_path).expanduser()
    if target.exists() and not overwrite:
        raise UserError(f"{target} already exists (pass --overwrite to replace it)")
    source = resolve_model_path(model_path)
    model, config = load_model(source)
    load_adapters(model, adapter_path)
    fuse_adapters(model, dequantize=dequantize)
    if dequantize:
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    for stale in remove_stale_temporaries(target.parent, target.name):
        log(f"removed {stale}, left by an interrupted run")
    weights = dict(tree_flatten(model.parameters()))
    save_model_folder(target, config, weights, tokenizer_files_of(source), overwrite=overwrite)
    return target
