"""Convert a Hugging Face checkpoint, a local folder or a hub repo id, into an MLX folder.

    python convert/from_hf.py --hf-path HuggingFaceTB/SmolLM2-135M-Instruct --mlx-path smollm2-4bit -q
    python convert/from_hf.py --hf-path ./my-model --mlx-path my-model-f16 --dtype float16

The folder holds safetensors (one file or shards) or PyTorch .bin files (read without
running pickled code), or is an MLX folder written by mlx-lm (quantized ones too); its
config.json names the family. Every tensor is checked against the model the config
describes before anything is written, and the output is written to a temporary folder
renamed into place at the end. The flags are mlx_lm.convert's (and mlx-tfm convert's).
"""

from __future__ import annotations

import argparse
import sys

import mlx_tfm  # noqa: F401  (routes BLAS before mlx.core loads)
from mlx_tfm.cli import run_command
from mlx_tfm.cli.convert import add_settings_arguments, convert_with


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-path", required=True, help="A local folder or a Hugging Face repo id.")
    add_settings_arguments(parser)
    parser.set_defaults(_run=lambda args: convert_with(args, args.hf_path, "hub"))
    return run_command(parser.parse_args())[0]  # a UserError is one `error:` line and exit status 1


if __name__ == "__main__":
    sys.exit(main())
