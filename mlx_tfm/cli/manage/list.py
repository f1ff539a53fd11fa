"""`mlx-tfm list`: the models in the Hugging Face cache and the folders converted here."""

from __future__ import annotations

from . import human_count, human_size, human_time, local_models

HELP = "List the models in the Hugging Face cache and the folders `mlx-tfm convert` wrote."
COLUMNS = ("NAME", "SOURCE", "FAMILY", "PARAMS", "QUANTIZATION", "SIZE", "LAST USED")


def add_arguments(parser) -> None:
    pass


def rows() -> list[tuple[str, ...]]:
    return [(m.folder.name, m.source, m.folder.family, human_count(m.folder.parameters), m.folder.quantization,
             human_size(m.folder.size_bytes), human_time(m.folder.last_used)) for m in local_models()]


def run(args) -> int:
    table = rows()
    if not table:
        print("no models yet: `mlx-tfm pull REPO` downloads one, `mlx-tfm convert` writes one")
        return 0
    widths = [max(len(row[i]) for row in [COLUMNS, *table]) for i in range(len(COLUMNS))]
    for row in [COLUMNS, *table]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0
