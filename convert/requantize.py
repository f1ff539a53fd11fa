"""Quantize an MLX folder again, with other bits or group size (or quantize a float one).

    python convert/requantize.py --model smollm2-8bit --mlx-path smollm2-4bit --q-bits 4
    python convert/requantize.py --model smollm2-4bit --mlx-path smollm2-3-6 --q-bits 3 --quant-predicate mixed_3_6

A quantized folder is dequantized first (to --dtype, else its own), then quantized with
the new settings: the result carries the rounding of both, so from a float folder is
better where there is one. mlx-lm and mlx-tfm read the folder it writes.
"""

from __future__ import annotations

import argparse
import sys

import mlx_tfm  # noqa: F401  (routes BLAS before mlx.core loads)
from mlx_tfm.cli import run_command
from mlx_tfm.cli.convert import add_settings_arguments, convert_with


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="The MLX folder to quantize again.")
    add_settings_arguments(parser, quantize_flags=False)
    parser.set_defaults(_run=lambda args: convert_with(args, args.model, "folder"))
    return run_command(parser.parse_args())[0]  # a UserError is one `error:` line and exit status 1


if __name__ == "__main__":
    sys.exit(main())
