"""Pre-training from scratch, as ``mlx-tfm train`` runs it: build, train, checkpoint, plot.

The output folder holds the final model (loadable with ``mlx_tfm.load``), the newest
checkpoints under ``checkpoints/``, ``training_log.json`` and the PNG plots.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim

from ..atomic import atomic_files_into, remove_stale_temporaries
from ..errors import UserError
from ..model import Model, count_parameters
from .checkpoints import CHECKPOINTS, list_checkpoints, load_checkpoint, model_config, save_checkpoint, write_json, write_model
from .data import ByteTokenizer, TokenWindows, load_corpus, load_training_tokenizer, tokenizer_folder
from .presets import model_args_for
from .reporting import ProgressReporter
from .schedule import warmup_cosine
from .trainer import TrainingArgs, TrainingDiverged, train

# Flags that fix the trajectory and its record: a resumed run takes them from its checkpoint.
TRAJECTORY = (
    "config", "tokenizer", "data", "val_fraction", "iters", "batch_size", "seq_len", "learning_rate",
    "min_learning_rate", "warmup_steps", "weight_decay", "grad_clip", "grad_accumulation_steps", "seed",
    "val_batches", "steps_per_eval", "log_grad_norms",
)  # fmt: skip


def restore_settings(args: argparse.Namespace, checkpoint: Path, names: tuple[str, ...]) -> dict:
    """Put the checkpoint's trajectory settings back into ``args``; return its loop state."""
    state = json.loads((checkpoint / "trainer" / "state.json").read_text())
    for name in names:
        setattr(args, name, state["settings"][name])
    return state


def build_optimizer(args: argparse.Namespace) -> optim.Optimizer:
    schedule = warmup_cosine(args.learning_rate, args.iters, args.warmup_steps, args.min_learning_rate)
    return optim.AdamW(learning_rate=schedule, weight_decay=args.weight_decay)


def validate_flags(args: argparse.Namespace) -> None:
    for name in ("iters", "batch_size", "seq_len", "grad_accumulation_steps", "save_every", "steps_per_report"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")


def pretrain(args: argparse.Namespace) -> int:
    output = Path(args.output).expanduser()
    for stale in remove_stale_temporaries(output) + remove_stale_temporaries(output / CHECKPOINTS):
        print(f"removed {stale}, left by an interrupted run", file=sys.stderr)
    checkpoints = list_checkpoints(output)
    if checkpoints and not args.resume:
        raise UserError(f"{output} already has checkpoints; pass --resume to continue, or choose another --output")
    if args.resume and not checkpoints:
        raise UserError(f"--resume: {output} has no checkpoint to continue from")
    state = restore_settings(args, checkpoints[-1], TRAJECTORY) if args.resume else None
    validate_flags(args)

    tokenizer = load_training_tokenizer(args.tokenizer)
    tokenizer_source = tokenizer if isinstance(tokenizer, ByteTokenizer) else tokenizer_folder(args.tokenizer)
    model_args = model_args_for(args.config, tokenizer.vocab_size)
    config = model_config(model_args, tokenizer.bos_token_id, sorted(tokenizer.eos_token_ids))
    train_tokens, valid_tokens = load_corpus(args.data, tokenizer, args.val_fraction)
    windows = TokenWindows(train_tokens, args.batch_size, args.seq_len, args.seed)
    valid = TokenWindows(valid_tokens, args.batch_size, args.seq_len, args.seed) if len(valid_tokens) > args.seq_len + 1 else None

    mx.random.seed(args.seed)
    model = Model(model_args)
    optimizer = build_optimizer(args)
    start_step = 0
    if state is not None:
        load_checkpoint(checkpoints[-1], model, optimizer)
        start_step = state["step"]
        print(f"Resuming from {checkpoints[-1]} (step {start_step}) with its settings", file=sys.stderr)
    mx.eval(model.parameters())
    print(
        f"Model: {count_parameters(model) / 1e6:.3f}M parameters, {model_args.num_hidden_layers} layers; "
        f"corpus: {len(train_tokens)} training / {len(valid_tokens)} validation tokens",
        file=sys.stderr,
    )

    settings = {name: getattr(args, name) for name in TRAJECTORY}
    reporter = ProgressReporter(args.iters, start_step, state["history"] if state else None)

    def save(step: int) -> Path:
        loop_state = {"settings": settings, "history": reporter.history}
        return save_checkpoint(output, step, model, optimizer, config, tokenizer_source, loop_state, args.keep_checkpoints)

    reporter.save = save
    training_args = TrainingArgs(
        batch_size=args.batch_size,
        iters=args.iters,
        val_batches=args.val_batches,
        steps_per_report=args.steps_per_report,
        steps_per_eval=args.steps_per_eval,
        steps_per_save=args.save_every,
        grad_accumulation_steps=args.grad_accumulation_steps,
        grad_clip=args.grad_clip or None,
        grad_checkpoint=args.grad_checkpoint,
        log_grad_norms=args.log_grad_norms,
        seed=args.seed,
    )
    valid_batches = (lambda: valid.evaluation(args.val_batches)) if valid is not None else None
    try:
        train(model, optimizer, windows.batch, valid_batches, training_args, reporter, start_step)
    except KeyboardInterrupt:
        reporter.close()
        print(f"\ninterrupted; {_last_checkpoint_note(output)}", file=sys.stderr)
        return 130
    except TrainingDiverged as e:
        reporter.close()
        raise UserError(f"{e}; {_last_checkpoint_note(output)}") from None
    finally:
        reporter.close()
    publish_model(output, model, config, tokenizer_source)
    finish(output, reporter.history, args)
    return 0


def _last_checkpoint_note(output: Path) -> str:
    checkpoints = list_checkpoints(output)
    if not checkpoints:
        return "no checkpoint was saved yet"
    return f"the last good checkpoint is {checkpoints[-1]} (continue with --resume)"


def publish_model(output: Path, model, config: dict, tokenizer_source) -> None:
    """Write the final model into ``output`` beside its checkpoints, file by file atomically."""
    with atomic_files_into(output) as staging:
        write_model(staging, model, config, tokenizer_source)


def finish(output: Path, history: dict, args: argparse.Namespace) -> None:
    from .plots import plot_grad_norms, plot_losses

    write_json(output / "training_log.json", history)
    plot_losses(output / "loss_curve.png", history["train"], history["valid"], title=f"pre-training {args.config}")
    print(f"Saved the model to {output} and the loss curve to {output / 'loss_curve.png'}")
    if history["grad_norms"]:
        plot_grad_norms(output / "grad_norms.png", history["grad_norm_steps"], history["grad_norms"])
        print(f"Saved per-layer gradient norms to {output / 'grad_norms.png'}")
