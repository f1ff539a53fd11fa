"""`mlx-tfm rm MODEL`: remove a cached hub model or a converted folder `mlx-tfm list` shows."""

from __future__ import annotations

import shutil
import sys

from ...errors import UserError
from . import find_local_model, human_size

HELP = "Remove a model `mlx-tfm list` shows (a hub cache entry or a converted folder); asks first."


def add_arguments(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a hub repo id or converted folder, as `mlx-tfm list` names it")
    parser.add_argument("-y", "--yes", action="store_true", help="remove without asking")


def confirmed(question: str) -> bool:
    if not sys.stdin.isatty():
        raise UserError("rm needs a confirmation and there is no terminal to ask: pass --yes")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def run(args) -> int:
    from ...hub import delete_cached
    from ...weights.catalog import forget

    model = find_local_model(args.model)
    where = "from the Hugging Face cache" if model.source == "hub" else f"({model.folder.path})"
    if not args.yes and not confirmed(f"remove {model.folder.name} {where}, {human_size(model.folder.size_bytes)}?"):
        print("nothing removed")
        return 1
    if model.source == "hub":
        delete_cached(model.repo_id)
    else:
        shutil.rmtree(model.folder.path)
        forget(model.folder.path)
    print(f"removed {model.folder.name}")
    return 0
