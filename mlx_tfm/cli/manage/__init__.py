"""`mlx-tfm list`, `show`, `pull`, `rm` and `ps`: the models on this machine (the Hugging
Face cache and the folders `mlx-tfm convert` wrote) and the one a running server holds.
Each subcommand is a module here; this one finds the models they name and formats sizes."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from ...errors import UserError


@dataclass(frozen=True)
class LocalModel:
    """A model `mlx-tfm list` shows: where it is kept ("hub" or "converted") and its folder's description."""

    source: str
    folder: object  # weights.catalog.ModelFolder
    repo_id: str | None = None  # the hub repo (source "hub")


def hub_models(last_used: dict) -> list[LocalModel]:
    from ...hub import cached_repos, newest_snapshot
    from ...weights.catalog import describe_folder, looks_like_a_model

    models = []
    for repo in cached_repos():
        snapshot = newest_snapshot(repo)
        if snapshot is None or not looks_like_a_model(snapshot):
            continue
        used = max((last_used.get(str(Path(r.snapshot_path).resolve()), 0) for r in repo.revisions), default=0)
        folder = replace(describe_folder(snapshot, name=repo.repo_id, last_used=used or None),
                         size_bytes=repo.size_on_disk)
        models.append(LocalModel("hub", folder, repo.repo_id))
    return models


def converted_models(last_used: dict) -> list[LocalModel]:
    from ...weights.catalog import converted_folders, describe_folder

    return [LocalModel("converted", describe_folder(path, name=str(path), last_used=last_used.get(str(path))))
            for path in converted_folders()]


def local_models() -> list[LocalModel]:
    """The cached hub models, then the converted folders (only those that look like models)."""
    from ...weights.catalog import read_registry

    last_used = read_registry()["last_used"]
    return hub_models(last_used) + converted_models(last_used)


def find_local_model(name: str) -> LocalModel:
    """The listed model ``name`` names: a hub repo id, or a converted folder's path."""
    for model in local_models():
        if model.repo_id == name:
            return model
        if model.source == "converted" and Path(name).expanduser().resolve() == model.folder.path.resolve():
            return model
    raise UserError(f"{name!r} is not among the models `mlx-tfm list` shows (a cached hub repo id or a "
                    "folder `mlx-tfm convert` wrote)")


def human_size(n_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n_bytes < 1000:
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    return f"{n_bytes:.1f} TB"


def human_count(parameters: int | None) -> str:
    if parameters is None:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.2f}{unit}"
    return str(parameters)


def human_time(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "never"
