"""How the subcommands' flags read and show: every default in ``--help``, free text (a
prompt, a stop string) that may begin with "-", and one output flag and one sequence-length
flag under every spelling the commands use for them (each command keeps mlx-lm's name
first and accepts the others as aliases)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

# argv strings cannot hold a NUL (exec ends a string there), so only ``mark_free_text``
# puts one in front of a value, and ``free_text`` takes it off again.
FREE_TEXT_MARK = "\0"

# How the commands spell "where to write" (mlx-lm's names: convert --mlx-path, fuse and lora
# --save-path); a command that writes takes its own first and the others as aliases.
OUTPUT_SPELLINGS = ("--mlx-path", "--save-path", "--output", "--out")
# A sequence length, as each command spells it: train, perplexity (mlx_lm.perplexity), lora (mlx_lm.lora).
LENGTH_SPELLINGS = ("--seq-len", "--sequence-length", "--max-seq-length")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each flag's default after its text, as
    ``ArgumentDefaultsHelpFormatter`` writes it, except where the text already gives it, for
    switches (off unless given), required flags, and flags without one (None: their text
    says what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.required or action.default is None:
            return text
        return super()._get_help_string(action)


def free_text(value: str) -> str:
    """The ``type`` of a flag whose value is any text: such a value may begin with "-"
    (``mark_free_text`` has argparse take it as a value)."""
    return value.removeprefix(FREE_TEXT_MARK)


def is_flag(token: str, options: set[str]) -> bool:
    """Whether argparse reads ``token`` as one of ``options``: the flag itself, with
    ``=value``, or an abbreviation of a long flag."""
    name = token.split("=", 1)[0] if token.startswith("--") else token
    return name in options or (len(name) > 2 and name.startswith("--") and any(o.startswith(name) for o in options))


def mark_free_text(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` (a subcommand's flags) with each value of a ``free_text`` flag that begins
    with "-" marked, so that ``--prompt -hi`` is the prompt "-hi" where argparse alone
    stops at "expected one argument". A token that is one of the command's flags is never
    taken for a value, so a value left out is still reported."""
    actions = {option: action for action in parser._actions for option in action.option_strings}
    options = set(actions)
    marked, i = list(argv), 0
    while i < len(marked) and marked[i] != "--":  # after "--" nothing is a flag's value
        action = actions.get(marked[i])
        i += 1
        if action is None or action.type is not free_text:
            continue
        while i < len(marked) and marked[i] != "--" and not is_flag(marked[i], options):
            if marked[i].startswith("-"):
                marked[i] = FREE_TEXT_MARK + marked[i]
            i += 1
            if action.nargs not in ("+", "*"):  # one value (an append flag takes one each time)
                break
    return marked


def output_flags(name: str, *more: str) -> list[str]:
    """The spellings of the flag for where a command writes: ``name`` (argparse names the
    value after it) and ``more`` of its own, then the other ``OUTPUT_SPELLINGS`` as
    aliases: no command refuses another's spelling."""
    return [name, *more] + [spelling for spelling in OUTPUT_SPELLINGS if spelling not in (name, *more)]


def add_output_argument(parser, name: str, *short: str, **kwargs) -> argparse.Action:
    """``parser``'s output flag under all its ``output_flags`` spellings."""
    return parser.add_argument(*output_flags(name, *short), **kwargs)


def length_flags(name: str) -> list[str]:
    """``name`` (this command's spelling of a sequence length) first, then the others."""
    return [name] + [flag for flag in LENGTH_SPELLINGS if flag != name]


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
