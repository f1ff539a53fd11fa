"""The options of the training commands and how they are checked: one rule per option,
one line per bad value. ``LoopOptions`` holds the options both commands share (what the
loop's ``TrainingArgs`` is built from); ``PretrainOptions`` (``mlx-tfm train``, here so
that its --help reads the defaults without loading MLX) and ``FinetuneOptions``
(``mlx-tfm lora``, beside its command) extend it. Each checks itself with
``check_options`` when created, so a bad flag or YAML value stops the run before anything
is loaded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UserError


@dataclass(frozen=True)
class Rule:
    """What an option's value must be: of ``kind`` (int, float, bool, str, dict, list; an
    int is a float too, a bool is neither), ``is_valid``, or None if ``optional``."""

    kind: type
    is_valid: Callable[[Any], bool] = lambda value: True
    expected: str = ""  # what a valid value looks like; "" names the kind
    optional: bool = False


KIND_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "text", dict: "a mapping",
              list: "a list"}


def whole(at_least: int) -> Rule:
    return Rule(int, lambda value: value >= at_least, f"a whole number >= {at_least}")


def positive() -> Rule:
    return Rule(float, lambda value: value > 0, "a number > 0")


def non_negative() -> Rule:
    return Rule(float, lambda value: value >= 0, "a number >= 0")


def one_of(choices) -> Rule:
    return Rule(str, lambda value: value in choices, f"one of {', '.join(choices)}")


def has_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def check_options(values: dict[str, Any], rules: dict[str, Rule], spell: Callable[[str], str]) -> None:
    """UserError for the first option that breaks its rule (one left out is None);
    ``spell(name)`` says how the person wrote it (``--batch-size``, ``batch_size``...)."""
    for name, rule in rules.items():
        value = values.get(name)
        if value is None and rule.optional:
            continue
        if not (has_kind(value, rule.kind) and rule.is_valid(value)):
            raise UserError(f"{spell(name)} must be {rule.expected or KIND_NAMES[rule.kind]}, not {value!r}")


# -- the options themselves --------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoopOptions:
    """The options both training commands share, by their flag names (``--batch-size`` is
    ``batch_size``), with mlx_lm.lora's defaults; ``trainer.training_args`` turns them into
    the loop's ``TrainingArgs``. A command's options extend this class and may give a field
    another default."""

    batch_size: int = 4
    iters: int = 1000
    val_batches: int = 25  # <= 0: all
    steps_per_report: int = 10
    steps_per_eval: int = 200  # 0: never
    save_every: int = 100
    grad_accumulation_steps: int = 1
    grad_checkpoint: bool = False
    log_grad_norms: bool = False
    seed: int = 0


LOOP_RULES = {
    "batch_size": whole(1), "iters": whole(1), "val_batches": Rule(int), "steps_per_report": whole(1),
    "steps_per_eval": whole(0), "save_every": whole(1), "grad_accumulation_steps": whole(1),
    "grad_checkpoint": Rule(bool), "log_grad_norms": Rule(bool), "seed": whole(0),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PretrainOptions(LoopOptions):
    """What ``mlx-tfm train`` runs with: its flags by name, with their defaults. Checked
    when created: a bad value is one line naming the flag."""

    data: str
    objective: str = "clm"  # "clm": the next token (a decoder); "mlm": BERT's masked tokens (training/mlm.py)
    config: str = "tiny"  # a preset (micro, tiny, small) or a ModelArgs JSON file
    tokenizer: str = "byte"
    output: str = "trained_model"
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: off
    val_fraction: float = 0.1
    val_batches: int = 10  # <= 0: all
    steps_per_eval: int = 100  # 0: never
    keep_checkpoints: int = 2
    resume: bool = False

    def __post_init__(self):
        check_options(vars(self), PRETRAIN_RULES, spell=lambda name: "--" + name.replace("_", "-"))


PRETRAIN_RULES = {
    **LOOP_RULES,
    "data": Rule(str), "objective": one_of(("clm", "mlm")), "config": Rule(str), "tokenizer": Rule(str), "output": Rule(str),
    "seq_len": whole(1), "learning_rate": positive(), "min_learning_rate": non_negative(), "warmup_steps": whole(0),
    "weight_decay": non_negative(), "grad_clip": non_negative(),
    "val_fraction": Rule(float, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "keep_checkpoints": whole(1), "resume": Rule(bool),
}  # fmt: skip

# A resumed run continues its checkpoint's trajectory: these fix it (the model, the data and
# its order, the batches, the learning rates), so the checkpoint's values hold over any flag.
KEPT_ON_RESUME = (
    "objective", "config", "tokenizer", "data", "val_fraction", "batch_size", "seq_len", "learning_rate",
    "min_learning_rate", "warmup_steps", "weight_decay", "grad_clip", "grad_accumulation_steps", "seed",
)  # fmt: skip
# The run's length and bookkeeping: a flag given on resume wins, else the checkpoint's value.
FOLLOWED_ON_RESUME = (
    "iters", "val_batches", "steps_per_report", "steps_per_eval", "save_every", "keep_checkpoints",
    "log_grad_norms", "grad_checkpoint",
)  # fmt: skip


def changed_from_defaults(options) -> frozenset[str]:
    """The names of the options whose value is not their field's default: what a caller of
    the Python API set, as far as the options can tell."""
    changed = set()
    for field in dataclasses.fields(options):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if getattr(options, field.name) != default:
            changed.add(field.name)
    return frozenset(changed)
