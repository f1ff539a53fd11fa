"""Model folders and resumable checkpoints, written so that a crash never corrupts one.

A model folder (``config.json``, ``model.safetensors``, tokenizer files) is what
``mlx_tfm.load`` reads: the config is Hugging Face Llama style, with our ``ModelArgs``
fields spread in (the llama entry of convert/architectures.py passes them through).

A checkpoint is a model folder plus ``trainer/`` (optimizer state and the loop's
position: step, loss history). Each is written to a temporary folder and renamed into
place, so after Ctrl-C, a kill or a full disk the previous checkpoint is still whole.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import atomic_file, atomic_folder
from ..errors import UserError
from ..families import model_args_from_config
from ..jsonfile import read_json
from ..model.config import ModelArgs
from ..weights.build import load_weights_strictly
from ..weights.files import tokenizer_files_of, write_model_files

CHECKPOINTS = "checkpoints"
TRAINER = "trainer"


def model_config(args: ModelArgs, bos_token_id: int | None, eos_token_ids: list[int]) -> dict:
    """config.json for ``args``; fails if loading it back would build a different model."""
    config = {
        **args.to_dict(),
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": args.norm_eps,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids),
    }
    if model_args_from_config(config) != args:
        raise UserError(
            "this model variant cannot be saved as a llama config.json (norm_type must be rmsnorm and "
            "attention_out_bias equal attention_bias)"
        )
    return config


def tokenizer_files(tokenizer_source) -> dict[str, bytes]:
    """A folder's tokenizer files, or those of an object with ``files()`` (the byte tokenizer)."""
    return tokenizer_files_of(tokenizer_source) if isinstance(tokenizer_source, Path) else tokenizer_source.files()


def write_model(folder: Path, model: nn.Module, config: dict, tokenizer_source) -> None:
    """config.json, model.safetensors and the tokenizer files into ``folder``."""
    write_model_files(folder, config, dict(tree_flatten(model.parameters())), tokenizer_files(tokenizer_source))


def checkpoint_folder(root: Path, step: int) -> Path:
    return root / CHECKPOINTS / f"step-{step:07d}"


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: optim.Optimizer,
    config: dict,
    tokenizer_source,
    state: dict,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically, then drop all but the newest ``keep``."""
    target = checkpoint_folder(root, step)
    with atomic_folder(target, overwrite=True) as tmp:
        write_model(tmp, model, config, tokenizer_source)
        (tmp / TRAINER).mkdir()
        opt_state = dict(tree_flatten(optimizer.state))
        mx.save_safetensors(str(tmp / TRAINER / "optimizer.safetensors"), opt_state)
        (tmp / TRAINER / "state.json").write_text(json.dumps({**state, "step": step}) + "\n")
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return target


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders start with a dot)."""
    folder = root / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step-*") if (p / TRAINER / "state.json").is_file())


def load_checkpoint(folder: Path, model: nn.Module, optimizer: optim.Optimizer) -> dict:
    """Restore model weights and optimizer state in place; return the loop state."""
    try:
        weights = mx.load(str(folder / "model.safetensors"))
        opt_state = mx.load(str(folder / TRAINER / "optimizer.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"checkpoint {folder} is unreadable ({e})") from None
    state = read_json(folder / TRAINER / "state.json")
    load_weights_strictly(model, weights)
    optimizer.state = tree_unflatten(list(opt_state.items()))
    mx.eval(model.parameters(), optimizer.state)
    return state


def write_json(path: Path, data) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
