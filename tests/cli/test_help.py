"""The command line's flags as a new user meets them: every subcommand's parser (built
from the table in mlx_tfm/cli/__init__.py) gives each flag help text and shows its
default; `mlx-tfm --version`; the output flag under every spelling; free text (a prompt,
a system prompt, a query) that begins with "-"."""

import argparse
import importlib
import re
import subprocess
import sys

import pytest

import mlx_tfm
from mlx_tfm.cli import SUBCOMMANDS, build_parser, main

# Reprs that tell a user nothing about what happens without the flag.
UNINFORMATIVE_DEFAULTS = ("(default: None)", "(default: [])", "(default: False)", "(default: True)")


@pytest.fixture(scope="module")
def subparsers():
    modules = {name: importlib.import_module(module) for name, module in SUBCOMMANDS.items()}
    return build_parser(modules)[1]


def help_entries(parser, monkeypatch) -> dict[str, str]:
    """Each flag's entry in the rendered --help (invocation and text, whitespace collapsed),
    by its first option string."""
    monkeypatch.setenv("COLUMNS", "100")
    entries, current = {}, None
    for line in parser.format_help().splitlines():
        if re.match(r"  -", line):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line
        else:
            current = None  # a section title, a blank line or the usage
    return {option: " ".join(text.split()) for option, text in entries.items()}


def flags_of(parser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_flag_has_help_text_and_shows_its_default(subparsers, monkeypatch, command):
    parser = subparsers[command]
    entries = help_entries(parser, monkeypatch)
    faults = []
    for action in flags_of(parser):
        flag = action.option_strings[0]
        if not (action.help and action.help.strip()):
            faults.append(f"{flag} has no help text")
        takes_a_value = action.nargs != 0 and not action.required
        has_a_default = action.default not in (None, argparse.SUPPRESS)
        if takes_a_value and has_a_default and "default" not in entries[flag]:
            faults.append(f"{flag} hides its default {action.default!r}: {entries[flag]}")
    faults += [f"--help shows {useless}" for useless in UNINFORMATIVE_DEFAULTS if useless in parser.format_help()]
    assert not faults, f"mlx-tfm {command}:\n" + "\n".join(faults)


def test_generate_help_shows_the_defaults_it_runs_with(monkeypatch):
    """Read from what `mlx-tfm generate --help` prints, against the parser's own defaults."""
    from mlx_tfm.cli.generate import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT

    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", "--help"], capture_output=True, text=True,
                            timeout=120, env={**__import__("os").environ, "COLUMNS": "100"})
    assert result.returncode == 0 and result.stderr == ""
    text = " ".join(result.stdout.split())
    assert f"most tokens to generate (default: {DEFAULT_MAX_TOKENS})" in text
    assert f"(default: {DEFAULT_PROMPT})" in text
    assert re.search(r"--temp TEMP .*\(default: 0\.0\)", text)


def test_version():
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"mlx-tfm {mlx_tfm.__version__}\n"


@pytest.mark.parametrize("command,required,dest", [
    ("convert", ["--hf-path", "src"], "mlx_path"),
    ("embed", ["--model", "m", "--text", "t"], "output"),
    ("inspect", ["--model", "m"], "out"),
])
@pytest.mark.parametrize("spelling", ["--mlx-path", "--save-path", "--output", "--out"])
def test_every_output_spelling_names_the_commands_output(subparsers, command, required, dest, spelling):
    args = subparsers[command].parse_args([*required, spelling, "somewhere"])
    assert getattr(args, dest) == "somewhere"


def parsed(subparsers, argv):
    """The namespace `mlx-tfm ARGV` parses to, the way main reads it."""
    from mlx_tfm.cli.flags import mark_free_text

    return subparsers[argv[0]].parse_args(mark_free_text(argv[1:], subparsers[argv[0]]))


@pytest.mark.parametrize("argv,expected", [
    (["generate", "--prompt", "-hi", "--system-prompt", "-be brief", "--stop", "-x", "--stop", "--y"],
     {"prompt": "-hi", "system_prompt": "-be brief", "stop": ["-x", "--y"]}),
    (["generate", "-p", "-", "-m", "5"], {"prompt": "-", "max_tokens": 5}),
    (["generate", "--prompt=-hi"], {"prompt": "-hi"}),
    (["chat", "--system-prompt", "-terse"], {"system_prompt": "-terse"}),
    (["server", "--api-key", "-secret"], {"api_key": "-secret"}),
    (["embed", "--model", "m", "--text", "-a", "b", "--c", "--format", "npy"],
     {"text": ["-a", "b", "--c"], "format": "npy"}),
    (["fill-mask", "--model", "m", "--text", "-[MASK]-"], {"text": "-[MASK]-"}),
    (["rerank", "--model", "m", "--query", "-q", "--documents", "-d", "e"], {"query": "-q", "documents": ["-d", "e"]}),
    (["inspect", "--model", "m", "--prompt", "-once"], {"prompt": "-once"}),
])
def test_free_text_may_begin_with_a_dash(subparsers, argv, expected):
    args = parsed(subparsers, argv)
    assert {name: getattr(args, name) for name in expected} == expected


@pytest.mark.parametrize("argv", [["generate", "--prompt", "--max-tokens", "5"],
                                  ["generate", "--prompt", "--max-tok", "5"], ["generate", "--prompt"]])
def test_a_left_out_value_is_still_reported(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "argument --prompt/-p: expected one argument" in capsys.readouterr().err
