"""Checking the options of the training commands: one rule per option, one line per bad
value. ``PretrainOptions`` and ``FinetuneOptions`` (frozen dataclasses beside the command
they drive) check themselves with ``check_options`` when created, so a bad flag or YAML
value stops the run before anything is loaded."""

from __future__ import annotations

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
