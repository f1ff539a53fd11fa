"""``mlx-tfm convert``: flags as ``mlx_lm.convert``."""

from __future__ import annotations

import argparse

from .flags import add_output_argument

HELP = "Convert a Hugging Face, llama2.c, GGUF or MLX checkpoint into an MLX folder (optionally quantized)."


# The converter's settings, as mlx_lm.convert spells them (the top-level convert/ scripts
# use them too). Kept here as literals so that building the parser imports no MLX.
Q_GROUP_SIZES = (32, 64, 128)
Q_BITS = (2, 3, 4, 5, 6, 8)
DTYPES = ("float16", "bfloat16", "float32")
QUANT_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf-path",
        "--model",
        required=True,
        help="Source: a local folder, a llama2.c .bin or .gguf file, or a Hugging Face repo id.",
    )
    add_settings_arguments(parser)


def add_settings_arguments(parser: argparse.ArgumentParser, *, quantize_flags: bool = True) -> None:
    """--mlx-path and the settings of what is written. ``quantize_flags``: -q / -d (a script
    that always quantizes leaves them out)."""
    add_output_argument(parser, "--mlx-path", default="mlx_model", metavar="FOLDER",
                        help="Output folder (default: mlx_model).")
    if quantize_flags:
        parser.add_argument("-q", "--quantize", action="store_true", help="Quantize the weights.")
    parser.add_argument("--q-group-size", type=int, default=64, choices=Q_GROUP_SIZES,
                        help="Quantization group size (default 64).")
    parser.add_argument("--q-bits", type=int, default=4, choices=Q_BITS, help="Bits per weight (default 4).")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="Type of the non-quantized weights (default: config.json's torch_dtype, else the source's).")
    parser.add_argument("--quant-predicate", choices=QUANT_RECIPES, default=None,
                        help="With -q: mlx_lm.convert's mixed-bit recipe (e.g. mixed_3_6: 6 bits for the LM head and "
                             "for v_proj and down_proj in a third of the layers, 3 for the rest). Routers of "
                             "mixture-of-experts models stay at 8 bits. (default: none, every weight at --q-bits)")
    if quantize_flags:
        parser.add_argument("-d", "--dequantize", action="store_true", help="Dequantize a quantized source.")
        parser.add_argument("--quantize-vision", action="store_true",
                            help="With -q, quantize an image-text model's vision tower and projector too "
                                 "(default: they stay in float).")
    parser.add_argument("--overwrite", action="store_true", help="Replace --mlx-path if it exists.")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="Split the weights into files of at most this size (default 5GB).")


def run(args: argparse.Namespace) -> int:
    return convert_with(args, args.hf_path)


def convert_with(args: argparse.Namespace, source: str, kind: str | None = None) -> int:
    """Convert ``source`` with the flags of ``add_settings_arguments`` (without -q: always
    quantized); ``kind``: refuse a source of another kind first (converter.check_kind)."""
    from ..convert.converter import check_kind, convert

    if kind is not None:
        check_kind(source, kind)
    convert(source, args.mlx_path, quantize=getattr(args, "quantize", True), q_group_size=args.q_group_size,
            q_bits=args.q_bits, dtype=args.dtype, dequantize=getattr(args, "dequantize", False),
            overwrite=args.overwrite, max_shard_size=args.max_shard_size, quant_predicate=args.quant_predicate,
            quantize_vision=getattr(args, "quantize_vision", False))
    return 0
