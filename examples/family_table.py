"""Write docs/families.md, the family table, from the installed mlx-lm and transformers.

    python examples/family_table.py            # rewrite the page
    python examples/family_table.py --check    # exit 1 when the page is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_tfm.families.coverage import render_page

PAGE = Path(__file__).resolve().parents[1] / "docs" / "families.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether the page is up to date")
    args = parser.parse_args(argv)
    page = render_page()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        print(f"{PAGE} is {'up to date' if current == page else 'out of date'}")
        return 0 if current == page else 1
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
