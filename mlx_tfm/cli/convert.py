"""``mlx-tfm convert``: flags as ``mlx_lm.convert``."""

from __future__ import annotations

import argparse

from ..errors import UserError
from .flags import add_output_argument

HELP = "Convert a Hugging Face, llama2.c, GGUF or MLX checkpoint into an MLX folder (optionally quantized)."


# The converter's settings, as mlx_lm.convert spells them (the top-level convert/ scripts
# use them too). Kept here as literals so that building the parser imports no MLX.
Q_GROUP_SIZES = (32, 64, 128)
Q_BITS = (2, 3, 4, 5, 6, 8)
DTYPES = ("float16", "bfloat16", "float32")
QUANT_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf-path",
        "--model",
        required=True,
        help="Source: a local folder, a llama2.c .bin or .gguf file, or a Hugging Face repo id.",
    )
    add_settings_arguments(parser)
    parser.add_argument("--to-gguf", metavar="FILE", default=None,
                        help="Write a GGUF file for llama.cpp instead of an MLX folder (llama, mistral, qwen2, qwen3).")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES, default="f16",
                        help="With --to-gguf: the matrices' type (default f16; q8_0 / q4_0 by gguf's quantizer; "
                             "q4_k_m and the other K-quant mixes as llama.cpp's llama-quantize makes them).")
    parser.add_argument("--awq", action="store_true",
                        help="With -q: scale the weights by their calibrated activations first (AWQ); needs "
                             "--calibration-data.")
    parser.add_argument("--calibration-data", metavar="PATH", default=None,
                        help="With --awq: a .txt or .jsonl file, or a data folder (its train.jsonl).")
    parser.add_argument("--awq-num-samples", type=int, default=32,
                        help="With --awq: calibration windows (default 32).")
    parser.add_argument("--awq-sequence-length", type=int, default=512,
                        help="With --awq: tokens per calibration window (default 512).")


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
    if args.to_gguf:
        if args.quantize or args.dequantize:
            raise UserError("--to-gguf quantizes with --gguf-type (q8_0, q4_0, q4_k_m, ...), not -q / -d")
        from ..convert.gguf_export import export_gguf

        export_gguf(args.hf_path, args.to_gguf, args.gguf_type, overwrite=args.overwrite)
        return 0
    return convert_with(args, args.hf_path)


def convert_with(args: argparse.Namespace, source: str, kind: str | None = None) -> int:
    """Convert ``source`` with the flags of ``add_settings_arguments`` (without -q: always
    quantized); ``kind``: refuse a source of another kind first (converter.check_kind)."""
    from ..convert.converter import check_kind, convert

    if kind is not None:
        check_kind(source, kind)
    awq = None
    if getattr(args, "awq", False):
        if not args.calibration_data:
            raise UserError("--awq needs --calibration-data (a text file, a jsonl file or a data folder)")
        if args.awq_num_samples < 1 or args.awq_sequence_length < 2:
            raise UserError("--awq-num-samples must be at least 1 and --awq-sequence-length at least 2")
        awq = dict(data=args.calibration_data, samples=args.awq_num_samples, sequence_length=args.awq_sequence_length)
    convert(source, args.mlx_path, quantize=getattr(args, "quantize", True), q_group_size=args.q_group_size,
            q_bits=args.q_bits, dtype=args.dtype, dequantize=getattr(args, "dequantize", False),
            overwrite=args.overwrite, max_shard_size=args.max_shard_size, quant_predicate=args.quant_predicate,
            awq=awq, quantize_vision=getattr(args, "quantize_vision", False))
    return 0
