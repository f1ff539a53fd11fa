"""Write docs/families.md, the family table, and its summary in README.md, from the
installed mlx-lm and transformers.

    python examples/family_table.py            # rewrite the page and the README's table
    python examples/family_table.py --check    # exit 1 when either is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_tfm.families.coverage import render_page, render_readme_table, with_readme_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "families.md"
README = PAGE.parents[1] / "README.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the page is up to date")
    args = parser.parse_args(argv)
    wanted = {PAGE: render_page(), README: with_readme_table(README.read_text(), render_readme_table())}
    if args.check:
        stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
        for path in wanted:
            print(f"{path} is {'out of date' if path in stale else 'up to date'}")
        return 1 if stale else 0
    for path, text in wanted.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
