"""Convert a GGUF file (llama.cpp's format) into an MLX folder.

    python convert/from_gguf.py --gguf-path SmolLM2-135M-Instruct-Q8_0.gguf --mlx-path smollm2-q8
    python convert/from_gguf.py --gguf-path model-Q4_K_M.gguf --mlx-path model-4bit -q --q-group-size 32

Q8_0, Q4_0 and Q4_1 blocks are MLX's affine 8- and 4-bit groups of 32, so the most common
of them in the file is carried over bit for bit (the folder says bits 8 or 4, group 32);
every other tensor (F32, F16, BF16, Q5_0/1, the K-quants) is decoded to float, and -q
quantizes those. The tokenizer in the file's metadata becomes a tokenizer.model
(SentencePiece vocabularies) or a tokenizer.json (byte-level BPE, split as the family's
own tokenizer.json splits). Architectures: llama (and Mixtral), qwen2, qwen3, qwen3moe,
gemma3, olmo2, starcoder2, granite, smollm3, phi2.
"""

from __future__ import annotations

import argparse
import sys

import mlx_tfm  # noqa: F401  (routes BLAS before mlx.core loads)
from mlx_tfm.cli import run_command
from mlx_tfm.cli.convert import add_settings_arguments, convert_with


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf-path", required=True, help="The .gguf file.")
    add_settings_arguments(parser)
    parser.set_defaults(_run=lambda args: convert_with(args, args.gguf_path, "gguf"))
    return run_command(parser.parse_args())[0]  # a UserError is one `error:` line and exit status 1


if __name__ == "__main__":
    sys.exit(main())
