"""`mlx-tfm example-data`: write one of the small example datasets shipped in the package
(mlx_tfm/assets/examples/) into a folder, so the documentation's fine-tuning and training
commands run on data every installation has."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UserError

HELP = "Write a small example dataset (wikisql jsonl for lora, a Shakespeare text for train) into a folder."

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "examples"

# name -> what the set is for; its files are those of ASSETS / name.
SETS = {
    "wikisql": "train.jsonl (500 records), valid.jsonl (50), test.jsonl (50): WikiSQL text-to-SQL "
               'questions as mlx-lm\'s {"text": ...} records, for `mlx-tfm lora --data DIR`',
    "tinyshakespeare": "input.txt (100,020 characters of Shakespeare), for `mlx-tfm train --data DIR/input.txt`",
}

DATA_SUFFIXES = (".jsonl", ".txt")

EPILOG = "\n".join(
    ["what each set writes (with its README.md and license, which stay with the data):"]
    + [f"  {name}: {text}" for name, text in SETS.items()]
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("dir", metavar="DIR", help="the folder to write (made if missing; refused if not empty)")
    p.add_argument("--name", choices=sorted(SETS), default="wikisql", help="which set (default: wikisql)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty DIR: replace the set's files there, keep the others")


def run(args: argparse.Namespace) -> int:
    target = Path(args.dir)
    files = set_files(args.name)
    check_target(target, args.name, args.overwrite)
    write_files(files, target)
    print(f"Wrote the {args.name} example set to {target}:")
    for file in files:
        print(f"  {file.name:<12} {describe(file)}")
    return 0


def set_files(name: str) -> list[Path]:
    return sorted(p for p in (ASSETS / name).iterdir() if p.is_file())


def check_target(target: Path, name: str, overwrite: bool) -> None:
    """DIR must be a folder, or a path where one can be made; a non-empty one only with
    ``overwrite``, and never one that holds another set's data (one set per folder, so each
    set's README.md and license stay beside its data)."""
    for path in (target, *target.parents):
        if path.exists():
            if not path.is_dir():
                raise UserError(f"{path} is a file, not a folder")
            break
    if not target.is_dir() or not _has_entries(target):
        return
    if not overwrite:
        raise UserError(f"{target} is not empty (pass --overwrite to replace the example files in it)")
    ours = {p.name for p in set_files(name)}
    for other in sorted(SETS.keys() - {name}):
        clash = [p.name for p in set_files(other) if p.suffix in DATA_SUFFIXES and p.name not in ours
                 and (target / p.name).exists()]
        if clash:
            raise UserError(f"{target} holds {clash[0]} of the {other} example set: write {name} into another folder")


def write_files(files: list[Path], target: Path) -> None:
    """Copy ``files`` into ``target``, each file whole or not at all. A new folder appears
    with all of them at once; an existing one keeps its other files (an existing folder is
    never replaced itself: it may be the working directory)."""
    from ..atomic import atomic_files_into, atomic_folder, remove_stale_temporaries

    # What a killed run left: beside a new folder, or inside an existing one.
    stale = remove_stale_temporaries(target) + remove_stale_temporaries(target.parent, target.name)
    for path in stale:
        print(f"removed {path}, left by an interrupted run", file=sys.stderr)
    writer = atomic_files_into(target) if target.is_dir() else atomic_folder(target)
    with writer as tmp:
        for file in files:
            (tmp / file.name).write_bytes(file.read_bytes())


def _has_entries(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError as e:
        raise UserError(f"cannot read {folder}: {e.strerror or e}") from None


ABOUT = {"README.md": "where the data comes from, and its license", "LICENSE": "the license notices"}


def describe(file: Path) -> str:
    """One phrase for the summary: a data file's size, or what a text file is for."""
    if file.suffix == ".jsonl":
        text = file.read_text(encoding="utf-8")
        return f"{sum(1 for line in text.splitlines() if line.strip())} records"
    if file.suffix == ".txt":
        return f"{len(file.read_text(encoding='utf-8')):,} characters"
    return ABOUT[file.name]
