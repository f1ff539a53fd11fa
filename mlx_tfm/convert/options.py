"""The converter's settings as command-line flags, spelled as ``mlx_lm.convert`` spells
them, for the conversion scripts in the checkout's top-level ``convert/`` folder: each
script adds its own source flag, these, and runs ``convert_source``, which checks that the
source is of the script's kind before ``converter.convert`` reads it."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError
from ..weights.files import DTYPES
from ..weights.quantization import QUANT_RECIPES
from .converter import Q_BITS, Q_GROUP_SIZES, convert, source_kind

# How a message names each kind of source (converter.SOURCE_KINDS), and "hub": a local
# folder or a Hugging Face repo id.
KIND_NAMES = {"folder": "folder", "gguf": "GGUF file", "llama2c": "llama2.c checkpoint",
              "safetensors": "single safetensors file", "hub": "folder or Hugging Face repo id"}


def add_output_arguments(parser: argparse.ArgumentParser, *, quantize_flags: bool = True) -> None:
    """--mlx-path and the settings of what is written. ``quantize_flags``: -q / -d (a script
    that always quantizes leaves them out)."""
    parser.add_argument("--mlx-path", default="mlx_model", help="Output folder (default: mlx_model).")
    if quantize_flags:
        parser.add_argument("-q", "--quantize", action="store_true", help="Quantize the weights.")
    parser.add_argument("--q-group-size", type=int, default=64, choices=Q_GROUP_SIZES,
                        help="Quantization group size (default 64).")
    parser.add_argument("--q-bits", type=int, default=4, choices=Q_BITS, help="Bits per weight (default 4).")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="Type of the weights not quantized (default: config.json's torch_dtype, else the "
                             "source's).")
    parser.add_argument("--quant-predicate", choices=tuple(QUANT_RECIPES), default=None,
                        help="mlx_lm.convert's mixed-bit recipe (e.g. mixed_3_6: 6 bits for the LM head and for "
                             "v_proj and down_proj in a third of the layers, 3 for the rest).")
    if quantize_flags:
        parser.add_argument("-d", "--dequantize", action="store_true", help="Dequantize a quantized source.")
    parser.add_argument("--overwrite", action="store_true", help="Replace --mlx-path if it exists.")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="Split the weights into files of at most this size (default 5GB).")


def check_kind(source: str, kind: str) -> None:
    """UserError unless ``source`` is a ``kind`` (a key of KIND_NAMES). A file of no format
    mlx_tfm reads is left to the reader, whose message says so."""
    path = Path(source).expanduser()
    if kind == "hub" and not path.exists():
        return  # a repo id: the hub says whether it exists
    if not path.exists():
        raise UserError(f"{source} does not exist")
    found = source_kind(path)
    if found != "unknown" and found != kind and not (kind == "hub" and found == "folder"):
        raise UserError(f"{source} is a {KIND_NAMES[found]}, not a {KIND_NAMES[kind]}")


def convert_source(args: argparse.Namespace, source: str, kind: str) -> int:
    """Check ``source`` is a ``kind``, then convert it with the flags of
    ``add_output_arguments`` (without -q: always quantized)."""
    check_kind(source, kind)
    convert(source, args.mlx_path, quantize=getattr(args, "quantize", True), q_group_size=args.q_group_size,
            q_bits=args.q_bits, dtype=args.dtype, dequantize=getattr(args, "dequantize", False),
            overwrite=args.overwrite, max_shard_size=args.max_shard_size, quant_predicate=args.quant_predicate)
    return 0
