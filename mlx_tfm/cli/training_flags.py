"""Spellings and help text shared by the training and evaluation commands (`train`,
`lora`, `fuse`, `perplexity`).

Each command keeps mlx-lm's name for a flag and accepts the other commands' spellings as
aliases, so a length or an output folder is given the same way everywhere. Help texts
show each default, read from the options dataclass that holds it (one place, so the help
cannot drift from what runs).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

# A sequence length, as each command spells it: train, perplexity (mlx_lm.perplexity), lora (mlx_lm.lora).
LENGTH_FLAGS = ("--seq-len", "--sequence-length", "--max-seq-length")
OUTPUT_ALIASES = ("--output", "--out")


def length_flags(name: str) -> list[str]:
    """``name`` (this command's spelling, which argparse names the value after) first,
    then the others as aliases."""
    return [name] + [flag for flag in LENGTH_FLAGS if flag != name]


def output_flags(name: str, *more: str) -> list[str]:
    """``name`` (and ``more`` spellings of its own) with --output and --out as aliases."""
    return [name, *more] + [flag for flag in OUTPUT_ALIASES if flag not in (name, *more)]


def defaults_of(options_type: type) -> dict[str, Any]:
    """{field name: default} of an options dataclass (fields without a default left out)."""
    defaults = {}
    for field in dataclasses.fields(options_type):
        if field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
        elif field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
    return defaults


def described(text: str, default: Any) -> str:
    """``text`` with ``(default: X)``, inside a closing parenthesis it already has; a switch
    (off unless given) and an option with no default value (None) show none."""
    if default is None or isinstance(default, bool):
        return text
    if text.endswith(")"):
        return f"{text[:-1]}; default: {default})"
    return f"{text} (default: {default})"


def flag_adder(parser: argparse.ArgumentParser, options_type: type) -> Callable[..., argparse.Action]:
    """``add(*flags, help=..., **kwargs)``: ``parser.add_argument`` with the default of the
    option it sets (its ``dest``, a field of ``options_type``) written into its help."""
    defaults = defaults_of(options_type)

    def add(*flags: str, help: str, **kwargs) -> argparse.Action:
        action = parser.add_argument(*flags, help=help, **kwargs)
        action.help = described(help, defaults.get(action.dest))
        return action

    return add
