"""Convert a llama2.c checkpoint (karpathy/llama2.c's export.py) into an MLX folder.

    python convert/from_llama2c.py --llama2c-path stories15M.bin --mlx-path stories15M
    python convert/from_llama2c.py --llama2c-path model_q80.bin --mlx-path model --dtype float16

Reads the legacy format (a 7-number header, float32) and the versioned 'ak42' one
(version 1: float32; version 2: int8 Q8_0 groups, decoded to float). The SentencePiece
tokenizer must sit beside the checkpoint: tokenizer.model, or tok{vocab_size}.model as
llama2.c's train_vocab names it. llama2.c rotates adjacent pairs; the q and k rows are put
in Hugging Face's order, so the folder is a plain Llama that mlx-lm loads too.
"""

from __future__ import annotations

import argparse
import sys

import mlx_tfm  # noqa: F401  (routes BLAS before mlx.core loads)
from mlx_tfm.cli import run_command
from mlx_tfm.cli.convert import add_settings_arguments, convert_with


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama2c-path", required=True, help="The llama2.c .bin checkpoint.")
    add_settings_arguments(parser)
    parser.set_defaults(_run=lambda args: convert_with(args, args.llama2c_path, "llama2c"))
    return run_command(parser.parse_args())[0]  # a UserError is one `error:` line and exit status 1


if __name__ == "__main__":
    sys.exit(main())
