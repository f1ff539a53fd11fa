"""`mlx-tfm train`: pre-train a model from scratch on a text corpus."""

from __future__ import annotations

import argparse

from .flags import flag_adder, length_flags, output_flags

HELP = "Pre-train a small model from scratch (AdamW, warmup + cosine, resumable checkpoints)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..training.options import PretrainOptions

    # A flag left out stays out of the namespace, so a resumed run can tell the flags given
    # from the defaults (which live in PretrainOptions and are written into each help).
    p.argument_default = argparse.SUPPRESS
    flag = flag_adder(p, PretrainOptions)
    flag("--objective", help="clm: next token, a decoder; mlm: masked tokens, a BERT encoder")
    flag("--config", help="preset (micro, tiny, small) or a ModelArgs JSON file (mlm: BertConfig keys)")
    flag("--data", required=True, help="a .txt corpus or a folder with train.jsonl (and valid.jsonl)")
    flag("--tokenizer", help="'byte', or a folder with tokenizer.model / tokenizer.json")
    flag(*output_flags("--output", "-o"), help="output folder (model, checkpoints, plots)")
    flag("--iters", type=int, help="optimizer steps; on --resume, train on to this step")
    flag("--batch-size", type=int, help="sequences per optimizer step")
    flag(*length_flags("--seq-len"), type=int, help="tokens per training sequence")
    flag("--learning-rate", type=float, help="peak learning rate")
    flag("--min-learning-rate", type=float, help="where the cosine decay ends")
    flag("--warmup-steps", type=int, help="steps of linear warmup to the peak learning rate (at most --iters)")
    flag("--weight-decay", type=float, help="AdamW's decoupled weight decay")
    flag("--grad-clip", type=float, help="max global gradient norm (0: off)")
    flag("--grad-accumulation-steps", type=int, help="micro-batches summed into each optimizer step")
    flag("--grad-checkpoint", action="store_true", help="recompute activations to save memory")
    flag("--val-fraction", type=float, help="held-out tail of a .txt corpus")
    flag("--val-batches", type=int, help="validation batches (-1: all)")
    flag("--steps-per-report", type=int, help="print the training loss every N steps")
    flag("--steps-per-eval", type=int, help="validate every N steps (0: never)")
    flag("--save-every", type=int, help="checkpoint every N steps")
    flag("--keep-checkpoints", type=int, help="how many of the newest checkpoints to keep")
    flag("--log-grad-norms", action="store_true", help="record per-layer gradient norms, plot grad_norms.png")
    flag("--resume", action="store_true",
         help="continue from the newest checkpoint in --output, with its model, data, batches, learning rates and "
              "seed; --iters and the reporting, evaluation and saving flags given now apply")
    flag("--seed", type=int, help="seed of the initial weights, the data order and dropout")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from ..training.pretrain import PretrainOptions, pretrain

    names = {f.name for f in dataclasses.fields(PretrainOptions)}
    given = {name: value for name, value in vars(args).items() if name in names}
    return pretrain(PretrainOptions(**given), given=frozenset(given))
