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


# -- the models in the Hugging Face cache: `mlx-tfm list`, `pull`, `rm` ---------------------------


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (``HF_HUB_CACHE``, else
    ``$HF_HOME/hub``), so a changed ``HF_HOME`` counts even after huggingface_hub was imported."""
    import os

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_repos() -> list:
    """huggingface_hub's ``CachedRepoInfo`` of every model repo in the cache (none when there is no cache)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = hub_cache_dir()
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    return sorted((repo for repo in info.repos if repo.repo_type == "model"), key=lambda repo: repo.repo_id)


def newest_snapshot(repo) -> Path | None:
    """The snapshot folder of the repo's most recently modified revision."""
    revisions = sorted(repo.revisions, key=lambda revision: revision.last_modified)
    return Path(revisions[-1].snapshot_path) if revisions else None


def delete_cached(repo_id: str) -> int:
    """Remove every revision of ``repo_id`` from the cache (huggingface_hub's delete
    strategy: blobs no other revision shares go too); the bytes freed."""
    from huggingface_hub import scan_cache_dir

    repo = next((r for r in cached_repos() if r.repo_id == repo_id), None)
    if repo is None:
        raise UserError(f"{repo_id!r} is not in the Hugging Face cache {hub_cache_dir()}")
    strategy = scan_cache_dir(hub_cache_dir()).delete_revisions(*(r.commit_hash for r in repo.revisions))
    strategy.execute()
    return strategy.expected_freed_size


def pull(repo_id: str, download=None) -> Path:
    """Download ``repo_id``'s model files into the cache (huggingface_hub's progress bars
    show on stderr). ``download``: the download function (default: ``snapshot_download``)."""
    if not is_repo_id(repo_id):
        raise UserError(f"{repo_id!r} is not a Hugging Face repo id (name or org/name)")
    if download is None:
        from huggingface_hub import snapshot_download as download
    try:
        return Path(download(repo_id, allow_patterns=HUB_PATTERNS, cache_dir=hub_cache_dir()))
    except Exception as e:  # the hub raises many types: offline, gated, missing repo
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot download {repo_id!r} into the Hugging Face cache {hub_cache_dir()} "
                        f"(offline, or no such repo?): {reason}") from None
