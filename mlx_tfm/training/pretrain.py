"""Pre-training from scratch, as ``mlx-tfm train`` runs it: build, train, checkpoint, plot.

The output folder holds the final model (loadable with ``mlx_tfm.load``), the newest
checkpoints under ``checkpoints/``, ``training_log.json`` and the PNG plots.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim

from ..atomic import atomic_files_into, remove_stale_temporaries
from ..distributed.world import join
from ..errors import UserError
from ..jsonfile import read_json
from ..model.encoders import make_model
from ..model.transformer import count_parameters
from .checkpoints import (
    CHECKPOINTS,
    list_checkpoints,
    load_checkpoint,
    model_config,
    save_checkpoint,
    write_json,
    write_model,
)
from .data import (
    ByteTokenizer,
    TokenWindows,
    load_corpus,
    load_training_tokenizer,
    tokenizer_folder,
)
from .mlm import mlm_setup
from .options import Rule, check_options, non_negative, one_of, positive, whole
from .presets import model_args_for
from .reporting import ProgressReporter
from .schedule import warmup_cosine
from .trainer import TrainingArgs, TrainingDiverged, loss_fn, train


@dataclass(frozen=True)
class PretrainOptions:
    """What ``mlx-tfm train`` runs with: its flags by name, with their defaults. Checked
    when created: a bad value is one line naming the flag."""

    data: str
    objective: str = "clm"  # "clm": the next token (a decoder); "mlm": BERT's masked tokens (training/mlm.py)
    config: str = "tiny"  # a preset (micro, tiny, small) or a ModelArgs JSON file
    tokenizer: str = "byte"
    output: str = "trained_model"
    iters: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: off
    grad_accumulation_steps: int = 1
    grad_checkpoint: bool = False
    val_fraction: float = 0.1
    val_batches: int = 10  # <= 0: all
    steps_per_report: int = 10
    steps_per_eval: int = 100  # 0: never
    save_every: int = 100
    keep_checkpoints: int = 2
    log_grad_norms: bool = False
    resume: bool = False
    seed: int = 0

    def __post_init__(self):
        check_options(vars(self), PRETRAIN_RULES, spell=lambda name: "--" + name.replace("_", "-"))


PRETRAIN_RULES = {
    "data": Rule(str), "objective": one_of(("clm", "mlm")), "config": Rule(str), "tokenizer": Rule(str), "output": Rule(str),
    "iters": whole(1), "batch_size": whole(1), "seq_len": whole(1),
    "learning_rate": positive(), "min_learning_rate": non_negative(), "warmup_steps": whole(0),
    "weight_decay": non_negative(), "grad_clip": non_negative(), "grad_accumulation_steps": whole(1),
    "grad_checkpoint": Rule(bool), "val_fraction": Rule(float, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "val_batches": Rule(int), "steps_per_report": whole(1), "steps_per_eval": whole(0), "save_every": whole(1),
    "keep_checkpoints": whole(1), "log_grad_norms": Rule(bool), "resume": Rule(bool), "seed": whole(0),
}  # fmt: skip

# Options that fix the trajectory and its record: a resumed run takes them from its checkpoint.
TRAJECTORY = (
    "objective", "config", "tokenizer", "data", "val_fraction", "iters", "batch_size", "seq_len", "learning_rate",
    "min_learning_rate", "warmup_steps", "weight_decay", "grad_clip", "grad_accumulation_steps", "seed",
    "val_batches", "steps_per_eval", "log_grad_norms",
)  # fmt: skip


def restore_settings(options: PretrainOptions, checkpoint: Path) -> tuple[PretrainOptions, dict]:
    """The options with the checkpoint's trajectory settings put back, and its loop state."""
    state = read_json(checkpoint / "trainer" / "state.json")
    return dataclasses.replace(options, **{name: state["settings"][name] for name in TRAJECTORY}), state


def build_optimizer(options: PretrainOptions) -> optim.Optimizer:
    schedule = warmup_cosine(options.learning_rate, options.iters, options.warmup_steps, options.min_learning_rate)
    return optim.AdamW(learning_rate=schedule, weight_decay=options.weight_decay)


def training_args(options: PretrainOptions) -> TrainingArgs:
    return TrainingArgs(
        batch_size=options.batch_size,
        iters=options.iters,
        val_batches=options.val_batches,
        steps_per_report=options.steps_per_report,
        steps_per_eval=options.steps_per_eval,
        steps_per_save=options.save_every,
        grad_accumulation_steps=options.grad_accumulation_steps,
        grad_clip=options.grad_clip or None,
        grad_checkpoint=options.grad_checkpoint,
        log_grad_norms=options.log_grad_norms,
        seed=options.seed,
    )


def resume_point(options: PretrainOptions, output: Path) -> tuple[PretrainOptions, dict | None, Path | None]:
    """The options to run with, and the checkpoint to continue from with its loop state
    (None, None for a fresh run); temporaries of an interrupted run are removed first."""
    for stale in remove_stale_temporaries(output) + remove_stale_temporaries(output / CHECKPOINTS):
        print(f"removed {stale}, left by an interrupted run", file=sys.stderr)
    checkpoints = list_checkpoints(output)
    if checkpoints and not options.resume:
        raise UserError(f"{output} already has checkpoints; pass --resume to continue, or choose another --output")
    if options.resume and not checkpoints:
        raise UserError(f"--resume: {output} has no checkpoint to continue from")
    if not options.resume:
        return options, None, None
    return (*restore_settings(options, checkpoints[-1]), checkpoints[-1])


def pretrain(options: PretrainOptions) -> int:
    """Under mlx.launch, data parallel (as ``finetune``): rank 0 alone reads and writes the
    output folder; the other ranks take its settings and, resuming, its weights."""
    world = join()
    world.check_divides(options.batch_size)
    output = Path(options.output).expanduser()
    options, state, checkpoint = resume_point(options, output) if world.leader else (None, None, None)
    options, state = world.share((options, state))

    tokenizer = load_training_tokenizer(options.tokenizer)
    tokenizer_source = tokenizer if isinstance(tokenizer, ByteTokenizer) else tokenizer_folder(options.tokenizer)
    if options.objective == "mlm":
        model_args, config, loss = mlm_setup(options.config, tokenizer, options.seq_len)
    else:
        model_args = model_args_for(options.config, tokenizer.vocab_size)
        config = model_config(model_args, tokenizer.bos_token_id, sorted(tokenizer.eos_token_ids))
        loss = loss_fn
    train_tokens, valid_tokens = load_corpus(options.data, tokenizer, options.val_fraction)
    windows = TokenWindows(train_tokens, options.batch_size, options.seq_len, options.seed)
    has_valid = len(valid_tokens) > options.seq_len + 1
    valid = TokenWindows(valid_tokens, options.batch_size, options.seq_len, options.seed) if has_valid else None

    mx.random.seed(options.seed)
    model = make_model(model_args)
    optimizer = build_optimizer(options)
    start_step = 0
    if state is not None:
        start_step = state["step"]
    if checkpoint is not None:
        load_checkpoint(checkpoint, model, optimizer)
        print(f"Resuming from {checkpoint} (step {start_step}) with its settings", file=sys.stderr)
    world.start_alike(model, trainable_only=False)
    if state is not None and world.size > 1:
        optimizer.state = world.share_arrays(optimizer.state if world.leader else None)
    mx.eval(model.parameters())
    if world.leader:
        print(
            f"Model: {count_parameters(model) / 1e6:.3f}M parameters, {model_args.num_hidden_layers} layers; "
            f"corpus: {len(train_tokens)} training / {len(valid_tokens)} validation tokens",
            file=sys.stderr,
        )

    settings = {name: getattr(options, name) for name in TRAJECTORY}
    reporter = ProgressReporter(options.iters, start_step, state["history"] if state else None)

    def save(step: int) -> Path:
        loop_state = {"settings": settings, "history": reporter.history}
        return save_checkpoint(output, step, model, optimizer, config, tokenizer_source, loop_state,
                               options.keep_checkpoints)

    reporter.save = save if world.leader else None
    valid_batches = (lambda: world.rows_of(valid.evaluation(options.val_batches))) if valid is not None else None
    try:
        train(model, optimizer, lambda i: world.rows(windows.batch(i)), valid_batches, training_args(options), reporter,
              start_step, loss, group=world.group)
    except KeyboardInterrupt:
        reporter.close()
        print(f"\ninterrupted; {_last_checkpoint_note(output)}", file=sys.stderr)
        return 130
    except TrainingDiverged as e:
        reporter.close()
        raise UserError(f"{e}; {_last_checkpoint_note(output)}") from None
    finally:
        reporter.close()
    if world.leader:
        publish_model(output, model, config, tokenizer_source)
        finish(output, reporter.history, options)
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


def finish(output: Path, history: dict, options: PretrainOptions) -> None:
    from .plots import plot_grad_norms, plot_losses

    write_json(output / "training_log.json", history)
    plot_losses(output / "loss_curve.png", history["train"], history["valid"], title=f"pre-training {options.config}")
    print(f"Saved the model to {output} and the loss curve to {output / 'loss_curve.png'}")
    if history["grad_norms"]:
        plot_grad_norms(output / "grad_norms.png", history["grad_norm_steps"], history["grad_norms"])
        print(f"Saved per-layer gradient norms to {output / 'grad_norms.png'}")
