"""Where a model comes from: a local path, or a Hugging Face repo id fetched into (or found
in) the standard Hugging Face cache. Offline, a repo that is not cached is one clear error."""

from __future__ import annotations

from pathlib import Path

from .errors import UserError


def resolve_model_path(path_or_repo: str | Path) -> Path:
    """A local folder or file as it is; otherwise a Hugging Face repo id (``gpt2`` or
    ``org/name``), fetched into the standard Hugging Face cache (or found there when
    offline)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo)
    if looks_like_a_path(text):
        raise UserError(f"model path {text!r} does not exist")
    if not is_repo_id(text):
        raise UserError(f"model path {text!r} does not exist (and it is not a Hugging Face repo id either)")
    return _download(text)


def looks_like_a_path(text: str) -> bool:
    """Only a path is written this way: from the root, the home or this folder, or with
    more folders than a repo id's one ``org/``."""
    return text.startswith(("/", "~", "./", "../")) or text.count("/") > 1


def is_repo_id(text: str) -> bool:
    """A repo id as the hub itself validates one: ``name`` or ``org/name``."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


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
            f"cannot fetch {repo_id!r} from the Hugging Face hub and it is not in the local cache, nor a local path "
            f"({reason})"
        ) from None
