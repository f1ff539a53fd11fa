"""How the subcommands' flags read and show: every default in ``--help``, free text (a
prompt, a stop string) that may begin with "-", and one output flag under every spelling
the commands use for it."""

from __future__ import annotations

import argparse

# argv strings cannot hold a NUL (exec ends a string there), so only ``mark_free_text``
# puts one in front of a value, and ``free_text`` takes it off again.
FREE_TEXT_MARK = "\0"

# How the commands spell "where to write" (mlx-lm's names: convert --mlx-path, fuse and lora
# --save-path); a command that writes takes its own first and the others as aliases.
OUTPUT_SPELLINGS = ("--mlx-path", "--save-path", "--output", "--out")


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


def add_output_argument(parser, name: str, *short: str, **kwargs) -> argparse.Action:
    """The flag for where the command writes, as ``name`` (and ``short``), the other
    ``OUTPUT_SPELLINGS`` accepted as aliases: no command refuses another's spelling."""
    aliases = [spelling for spelling in OUTPUT_SPELLINGS if spelling != name]
    return parser.add_argument(name, *short, *aliases, **kwargs)
