"""``load(path_or_repo) -> (model, tokenizer)``: find the checkpoint, build the model from
its config, load its weights strictly."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .cpu_linear import quantize_model, use_cpu_linears
from .errors import UserError
from .model import Model, ModelArgs


def resolve_model_path(path_or_repo: str | Path) -> Path:
    """A local folder or file as it is; otherwise a Hugging Face repo id, fetched into the
    standard Hugging Face cache (or found there when offline)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise UserError(f"model path {text!r} does not exist")
    return _download(text)


HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
# Older repos ship only PyTorch weights; fetched only when a repo has no safetensors.
HUB_PYTORCH_PATTERNS = ["*.json", "pytorch_model*.bin", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def _download(repo_id: str) -> Path:
    folder = _snapshot(repo_id, HUB_PATTERNS)
    if not any(folder.glob("*.safetensors")):
        folder = _snapshot(repo_id, HUB_PYTORCH_PATTERNS)
    return folder


def _snapshot(repo_id: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # the hub raises many types: offline, gated, missing repo
        try:  # a previous download may still be in the cache
            return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        except Exception:
            pass
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub and it is not in the local cache ({reason})"
        ) from None


def read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"{folder} has no config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config_path} is not valid JSON: {e}") from None


def read_safetensors(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no *.safetensors weights")
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as e:
            raise UserError(f"{file} is not a readable safetensors file ({e})") from None
    return weights


def apply_quantization(model: Model, quantization: dict, weights: dict) -> None:
    """Swap in quantized layers wherever the checkpoint carries quantized tensors (linear
    layers as ``mlx_tfm.cpu_linear.QuantizedLinear``, fast on the CPU too)."""

    quantize_model(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        class_predicate=lambda path, module: f"{path}.scales" in weights,
    )


def load_weights_strictly(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Every parameter present with its shape, nothing extra: or an error naming them."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise UserError(f"checkpoint is missing {len(missing)} tensor(s): {_names(missing)}")
    if unexpected:
        raise UserError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {_names(unexpected)}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise UserError(
                f"shape mismatch for {name}: checkpoint {tuple(value.shape)}, model {tuple(expected[name].shape)}"
            )
    model.load_weights(list(weights.items()), strict=False)


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def readable_folder(path: Path) -> Path:
    """llama2.c and GGUF files and PyTorch-only folders go through the converter first,
    into a temporary MLX folder; MLX and safetensors folders load as they are."""
    from convert.checkpoint import needs_conversion

    if not needs_conversion(path):
        return path
    from convert.converter import convert_to_temporary

    return convert_to_temporary(path)


def load_model(folder: str | Path, dtype: mx.Dtype | None = None) -> tuple[Model, dict]:
    """Build and fill the model of an MLX or Hugging Face safetensors folder."""
    from convert.architectures import map_weights, model_args_from_config

    folder = readable_folder(Path(folder))
    config = read_config(folder)
    try:
        args = model_args_from_config(config)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"{folder / 'config.json'} does not describe a model we can build: {e}") from None
    weights = map_weights(config, args, read_safetensors(folder))
    model = Model(args)
    quantization = config.get("quantization") or config.get("quantization_config")
    if quantization and "bits" in quantization:
        apply_quantization(model, quantization, weights)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    load_weights_strictly(model, weights)
    use_cpu_linears(model)  # the faster matrix products on MLX's CPU backend
    mx.eval(model.parameters())
    model.eval()
    return model, config


def load(path_or_repo: str | Path, adapter_path: str | Path | None = None, dtype: mx.Dtype | None = None):
    """Load a model and its tokenizer from a folder or a Hugging Face repo id."""
    from .tokenizer import load_tokenizer

    folder = readable_folder(resolve_model_path(path_or_repo))
    model, config = load_model(folder, dtype)
    if adapter_path is not None:
        from .training.lora import load_adapters

        load_adapters(model, adapter_path)
    tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer


__all__ = ["load", "load_model", "resolve_model_path", "ModelArgs"]
