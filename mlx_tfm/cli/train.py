"""`mlx-tfm train`: pre-train a model from scratch on a text corpus."""

from __future__ import annotations

import argparse

HELP = "Pre-train a small model from scratch (AdamW, warmup + cosine, resumable checkpoints)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    # A flag left out stays out of the namespace: the defaults live in PretrainOptions.
    p.argument_default = argparse.SUPPRESS
    p.add_argument("--objective", help="clm: next token, a decoder (default); mlm: masked tokens, a BERT encoder")
    p.add_argument("--config", help="preset (micro, tiny, small) or a ModelArgs JSON file (mlm: BertConfig keys)")
    p.add_argument("--data", required=True, help="a .txt corpus or a folder with train.jsonl (and valid.jsonl)")
    p.add_argument("--tokenizer", help="'byte', or a folder with tokenizer.model / tokenizer.json")
    p.add_argument("--output", "-o", help="output folder (model, checkpoints, plots)")
    p.add_argument("--iters", type=int, help="optimizer steps")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int, help="tokens per training sequence")
    p.add_argument("--learning-rate", type=float, help="peak learning rate")
    p.add_argument("--min-learning-rate", type=float, help="where the cosine decay ends")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--grad-clip", type=float, help="max global gradient norm (0: off)")
    p.add_argument("--grad-accumulation-steps", type=int)
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute activations to save memory")
    p.add_argument("--val-fraction", type=float, help="held-out tail of a .txt corpus")
    p.add_argument("--val-batches", type=int, help="validation batches (-1: all)")
    p.add_argument("--steps-per-report", type=int)
    p.add_argument("--steps-per-eval", type=int, help="0: never")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps")
    p.add_argument("--keep-checkpoints", type=int)
    p.add_argument("--log-grad-norms", action="store_true", help="record per-layer gradient norms, plot grad_norms.png")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output")
    p.add_argument("--seed", type=int)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from ..training.pretrain import PretrainOptions, pretrain

    given = vars(args)
    options = PretrainOptions(**{f.name: given[f.name] for f in dataclasses.fields(PretrainOptions) if f.name in given})
    return pretrain(options)
