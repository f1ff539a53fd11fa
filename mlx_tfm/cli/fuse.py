"""`mlx-tfm fuse`: merge LoRA / DoRA adapters into the base model (flags as mlx_lm.fuse)."""

from __future__ import annotations

import argparse

from .flags import output_flags

HELP = "Fuse trained adapters into the base model and save it as a model folder."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="base model folder or Hugging Face repo id")
    p.add_argument("--adapter-path", default="adapters", help="folder with adapters.safetensors (default: %(default)s)")
    p.add_argument(*output_flags("--save-path"), default="fused_model",
                   help="where to write the fused model (default: %(default)s)")
    p.add_argument("--dequantize", action="store_true", help="write float weights for a quantized base")
    p.add_argument("--overwrite", action="store_true", help="replace --save-path if it exists")
    p.add_argument("--export-gguf", action="store_true", help="also write the fused model as a GGUF file (F16)")
    p.add_argument("--gguf-path", default="ggml-model-f16.gguf",
                   help="the GGUF file, inside --save-path (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from ..training.fuse import fuse_model

    target = fuse_model(args.model, args.adapter_path, args.save_path, args.dequantize, overwrite=args.overwrite)
    print(f"Saved the fused model to {target}")
    if args.export_gguf:
        from ..convert.gguf_export import export_gguf

        export_gguf(target, target / args.gguf_path, "f16", overwrite=args.overwrite)
    return 0
