"""``python -m mlx_tfm.convert ...`` is ``mlx-tfm convert ...``: the same flags and messages."""

import sys

import mlx_tfm  # noqa: F401  (routes BLAS before mlx.core loads)

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
