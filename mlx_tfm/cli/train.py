"""`mlx-tfm train`: pre-train a model from scratch on a text corpus."""

from __future__ import annotations

import argparse

HELP = "Pre-train a small model from scratch (AdamW, warmup + cosine, resumable checkpoints)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiny", help="preset (micro, tiny, small) or a ModelArgs JSON file")
    p.add_argument("--data", required=True, help="a .txt corpus or a folder with train.jsonl (and valid.jsonl)")
    p.add_argument("--tokenizer", default="byte", help="'byte', or a folder with tokenizer.model / tokenizer.json")
    p.add_argument("--output", "-o", default="trained_model", help="output folder (model, checkpoints, plots)")
    p.add_argument("--iters", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-learning-rate", type=float, default=1e-4, help="where the cosine decay ends")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--grad-accumulation-steps", type=int, default=1)
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute activations to save memory")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out tail of a .txt corpus")
    p.add_argument("--val-batches", type=int, default=10, help="validation batches (-1: all)")
    p.add_argument("--steps-per-report", type=int, default=10)
    p.add_argument("--steps-per-eval", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--log-grad-norms", action="store_true", help="record per-layer gradient norms, plot grad_norms.png")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from ..training.pretrain import pretrain

    return pretrain(args)
