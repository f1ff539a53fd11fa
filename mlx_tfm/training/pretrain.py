"""Pre-training from scratch, as ``mlx-tfm train`` runs it: build, train, checkpoint, plot.

Each objective (``--objective``: ``clm``, the next token for a decoder; ``mlm``, BERT's
masked tokens) decides the model's shape, its config.json and the loss; the corpus, the
optimizer, resuming and the loop are the same for all of them.

The output folder holds the final model (loadable with ``mlx_tfm.load``), the newest
checkpoints under ``checkpoints/``, ``training_log.json`` and the PNG plots.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from ..atomic import atomic_files_into, remove_stale_temporaries
from ..distributed.world import World, join
from ..errors import UserError
from ..jsonfile import read_json
from ..model.config import ModelArgs
from ..model.encoders import make_model
from ..model.transformer import count_parameters
from .checkpoints import (
    CHECKPOINTS,
    TRAINER,
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
from .options import FOLLOWED_ON_RESUME, KEPT_ON_RESUME, PretrainOptions, changed_from_defaults
from .presets import model_args_for
from .reporting import ProgressReporter
from .schedule import warmup_cosine
from .trainer import TrainingDiverged, loss_fn, train, training_args

__all__ = ["PretrainOptions", "pretrain"]


# -- the objectives ------------------------------------------------------------------------


@dataclass(frozen=True)
class Objective:
    """What an objective decides: the model's shape, the config.json it is saved with, and
    the loss ``(model, tokens, lengths) -> (loss, ntoks)``."""

    model_args: ModelArgs
    config: dict
    loss: Callable


def causal_lm(options: PretrainOptions, tokenizer) -> Objective:
    """A Llama-style decoder of a preset or ModelArgs file, scored on the next token."""
    model_args = model_args_for(options.config, tokenizer.vocab_size)
    config = model_config(model_args, tokenizer.bos_token_id, sorted(tokenizer.eos_token_ids))
    return Objective(model_args, config, loss_fn)


def masked_lm(options: PretrainOptions, tokenizer) -> Objective:
    """A BERT scored on the tokens it finds masked (training/mlm.py)."""
    return Objective(*mlm_setup(options.config, tokenizer, options.seq_len))


OBJECTIVES: dict[str, Callable[[PretrainOptions, object], Objective]] = {"clm": causal_lm, "mlm": masked_lm}


# -- where a run starts: fresh, or from its newest checkpoint --------------------------------


@dataclass(frozen=True)
class Start:
    """The options a run goes with, the length of its learning-rate schedule, the loop
    state of the checkpoint it continues (None: a fresh run) and the lines to tell the
    person once it begins."""

    options: PretrainOptions
    schedule_steps: int
    state: dict | None = None
    notes: tuple[str, ...] = ()

    @property
    def step(self) -> int:
        return self.state["step"] if self.state else 0


def resume_point(options: PretrainOptions, output: Path, given: Collection[str]) -> tuple[Start, Path | None]:
    """Where the run starts, and the checkpoint it continues from (None for a fresh run);
    temporaries of an interrupted run are removed first. ``given``: the options the person
    set, which a resumed run follows where that keeps its trajectory."""
    for stale in remove_stale_temporaries(output) + remove_stale_temporaries(output / CHECKPOINTS):
        print(f"removed {stale}, left by an interrupted run", file=sys.stderr)
    checkpoints = list_checkpoints(output)
    if checkpoints and not options.resume:
        raise UserError(f"{output} already has checkpoints; pass --resume to continue, or choose another --output")
    if options.resume and not checkpoints:
        raise UserError(f"--resume: {output} has no checkpoint to continue from")
    if options.resume:
        return resumed(options, checkpoints[-1], given), checkpoints[-1]
    return fresh(options, given), None


def fresh(options: PretrainOptions, given: Collection[str]) -> Start:
    """A new run. A warmup longer than the run would never reach the peak learning rate:
    the default one is shortened to the run, one the person set is refused."""
    if options.warmup_steps <= options.iters:
        return Start(options, options.iters)
    if "warmup_steps" in given:
        raise UserError(f"--warmup-steps {options.warmup_steps} is longer than the run (--iters {options.iters}); "
                        f"give at most {options.iters} warmup steps")
    note = (f"note: the default warmup of {options.warmup_steps} steps is longer than the run: warming up over "
            f"its {options.iters} steps (--iters)")
    return Start(dataclasses.replace(options, warmup_steps=options.iters), options.iters, notes=(note,))


def resumed(options: PretrainOptions, checkpoint: Path, given: Collection[str]) -> Start:
    """The run continued from ``checkpoint``: its trajectory settings whatever the flags
    say (one line names each given flag they override), the flags given for the run's
    length and bookkeeping, else the checkpoint's values."""
    state = read_json(checkpoint / TRAINER / "state.json")
    saved = state["settings"]
    notes = [overridden_note(options, saved, given)]
    followed = {name: saved[name] for name in FOLLOWED_ON_RESUME if name in saved and name not in given}
    options = dataclasses.replace(options, **{name: saved[name] for name in KEPT_ON_RESUME}, **followed)
    if options.iters < state["step"]:
        raise UserError(f"--iters {options.iters}: the newest checkpoint, {checkpoint}, is already at step "
                        f"{state['step']}; give a larger --iters to train on")
    # The schedule keeps the length it was made with (older checkpoints: their --iters), so
    # the learning rates of the steps already taken stay those of the trajectory resumed.
    schedule_steps = saved.get("schedule_steps", saved["iters"])
    if options.iters > schedule_steps:
        notes.append(f"note: the learning-rate schedule keeps its {schedule_steps} steps: steps {schedule_steps + 1}"
                     f"-{options.iters} run at --min-learning-rate {options.min_learning_rate}")
    return Start(options, schedule_steps, state, tuple(note for note in notes if note))


def overridden_note(options: PretrainOptions, saved: dict, given: Collection[str]) -> str:
    """One line naming each given flag whose value the checkpoint's replaces ("" if none)."""
    overridden = [name for name in KEPT_ON_RESUME if name in given and getattr(options, name) != saved[name]]
    if not overridden:
        return ""
    values = ", ".join(f"{_flag(name)} {saved[name]} (not {getattr(options, name)})" for name in overridden)
    return f"warning: --resume keeps the checkpoint's {values}: they fix the trajectory it continues"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- the pieces of a run ------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """The training windows, the validation windows (None: too little held out) and how
    many tokens each part has."""

    train: TokenWindows
    valid: TokenWindows | None
    sizes: tuple[int, int]


def token_windows(options: PretrainOptions, tokenizer) -> Corpus:
    train_tokens, valid_tokens = load_corpus(options.data, tokenizer, options.val_fraction)
    windows = TokenWindows(train_tokens, options.batch_size, options.seq_len, options.seed)
    has_valid = len(valid_tokens) > options.seq_len + 1
    valid = TokenWindows(valid_tokens, options.batch_size, options.seq_len, options.seed) if has_valid else None
    return Corpus(windows, valid, (len(train_tokens), len(valid_tokens)))


def tokenizer_source(options: PretrainOptions, tokenizer):
    """What the output folders copy the tokenizer from: the byte tokenizer writes its own
    files, any other comes from its folder."""
    return tokenizer if isinstance(tokenizer, ByteTokenizer) else tokenizer_folder(options.tokenizer)


def build_optimizer(options: PretrainOptions, schedule_steps: int) -> optim.Optimizer:
    schedule = warmup_cosine(options.learning_rate, schedule_steps, options.warmup_steps, options.min_learning_rate)
    return optim.AdamW(learning_rate=schedule, weight_decay=options.weight_decay)


def build_model(model_args: ModelArgs, start: Start, checkpoint: Path | None, world: World
                ) -> tuple[nn.Module, optim.Optimizer]:
    """The model and its optimizer, seeded, or (resuming) as rank 0 reads them from
    ``checkpoint``; every other rank is sent rank 0's weights and optimizer state."""
    mx.random.seed(start.options.seed)
    model = make_model(model_args)
    optimizer = build_optimizer(start.options, start.schedule_steps)
    if checkpoint is not None:
        load_checkpoint(checkpoint, model, optimizer)
        print(f"Resuming from {checkpoint} (step {start.step})", file=sys.stderr)
    world.start_alike(model, trainable_only=False)
    if start.state is not None and world.size > 1:
        optimizer.state = world.share_arrays(optimizer.state if world.leader else None)
    mx.eval(model.parameters())
    return model, optimizer


# -- the command --------------------------------------------------------------------------


def pretrain(options: PretrainOptions, given: Collection[str] | None = None) -> int:
    """Train ``options.objective``'s model on ``options.data`` and write it to
    ``options.output``. ``given``: the names of the options the person set (the flags on
    the command line); a resumed run follows those that keep its trajectory, and only a
    warmup the person set is refused for being longer than the run. None: the options
    that differ from their defaults.

    Under mlx.launch, data parallel (as ``finetune``): rank 0 alone reads and writes the
    output folder; the other ranks take its settings and, resuming, its weights."""
    world = join()
    output = Path(options.output).expanduser()
    given = changed_from_defaults(options) if given is None else given
    start, checkpoint = resume_point(options, output, given) if world.leader else (None, None)
    start = world.share(start)
    options = start.options
    world.check_divides(options.batch_size)

    tokenizer = load_training_tokenizer(options.tokenizer)
    objective = OBJECTIVES[options.objective](options, tokenizer)
    corpus = token_windows(options, tokenizer)
    model, optimizer = build_model(objective.model_args, start, checkpoint, world)
    if world.leader:
        for note in start.notes:
            print(note, file=sys.stderr)
        print(f"Model: {count_parameters(model) / 1e6:.3f}M parameters, {objective.model_args.num_hidden_layers} "
              f"layers; corpus: {corpus.sizes[0]} training / {corpus.sizes[1]} validation tokens", file=sys.stderr)
    source = tokenizer_source(options, tokenizer)
    code, history = run_loop(model, optimizer, objective, corpus, start, output, source, world)
    if code == 0 and world.leader:
        publish_model(output, model, objective.config, source)
        finish(output, history, options)
    return code


def run_loop(model, optimizer, objective: Objective, corpus: Corpus, start: Start, output: Path, source,
             world: World) -> tuple[int, dict]:
    """The shared loop, checkpointing into ``output`` (rank 0 only): the exit status (130
    when interrupted) and the loss history."""
    options = start.options
    reporter = ProgressReporter(options.iters, start.step, start.state["history"] if start.state else None)
    if world.leader:
        reporter.save = checkpoint_saver(output, model, optimizer, objective.config, source, start, reporter)
    valid = corpus.valid
    valid_batches = (lambda: world.rows_of(valid.evaluation(options.val_batches))) if valid is not None else None
    try:
        train(model, optimizer, lambda i: world.rows(corpus.train.batch(i)), valid_batches,
              training_args(options, options.grad_clip), reporter, start.step, objective.loss, group=world.group)
    except KeyboardInterrupt:
        reporter.close()
        print(f"\ninterrupted; {_last_checkpoint_note(output)}", file=sys.stderr)
        return 130, reporter.history
    except TrainingDiverged as e:
        reporter.close()
        raise UserError(f"{e}; {_last_checkpoint_note(output)}") from None
    finally:
        reporter.close()
    return 0, reporter.history


def checkpoint_saver(output: Path, model, optimizer, config: dict, source, start: Start, reporter: ProgressReporter):
    """``save(step) -> folder``: a checkpoint with the run's settings (all a resumed run
    reads back, the schedule's length included) and the history so far."""
    options = start.options
    settings = {name: getattr(options, name) for name in KEPT_ON_RESUME + FOLLOWED_ON_RESUME}
    settings["schedule_steps"] = start.schedule_steps

    def save(step: int) -> Path:
        loop_state = {"settings": settings, "history": reporter.history}
        return save_checkpoint(output, step, model, optimizer, config, source, loop_state, options.keep_checkpoints)

    return save


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
