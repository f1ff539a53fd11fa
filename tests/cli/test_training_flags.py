"""The flags of `train`, `lora`, `fuse` and `perplexity`: every flag has help text and shows
the default that applies, each command's length and output flags answer to the other
commands' spellings, and `fuse` refuses an existing output unless --overwrite (as
`convert` does)."""

import argparse
import dataclasses
import importlib

import pytest

from mlx_tfm.cli import SUBCOMMANDS, main

COMMANDS = ("train", "lora", "fuse", "perplexity")
LENGTH_SPELLINGS = ("--seq-len", "--sequence-length", "--max-seq-length")
REQUIRED = {"train": ["--data", "corpus.txt"], "lora": [], "fuse": ["--model", "m"],
            "perplexity": ["--model", "m", "--data", "d.txt"]}


def parser_of(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"mlx-tfm {command}")
    importlib.import_module(SUBCOMMANDS[command]).add_arguments(parser)
    return parser


def options_defaults(command: str) -> dict:
    """The defaults that apply where the parser leaves them to an options dataclass (train
    leaves a flag out, lora gives None so that a -c recipe can set it)."""
    if command == "train":
        from mlx_tfm.training.options import PretrainOptions as options
    elif command == "lora":
        from mlx_tfm.training.finetune import FinetuneOptions as options
    else:
        return {}
    return {f.name: f.default for f in dataclasses.fields(options) if f.default is not dataclasses.MISSING}


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's entry in --help as argparse prints it (%(default)s filled in), on one line."""
    formatter = parser.formatter_class(prog=parser.prog, width=100_000)
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_and_shows_its_default(command):
    parser = parser_of(command)
    defaults = options_defaults(command)
    shown = 0
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.help and action.help.strip(), f"{command} {flag} has no help text"
        default = defaults.get(action.dest, action.default)
        if default is None or default is argparse.SUPPRESS or isinstance(default, bool):
            continue  # nothing to show: no default value, or a switch that is off unless given
        assert f"default: {default}" in shown_help(parser, action), f"{command} {flag} hides its default {default!r}"
        shown += 1
    assert shown > 0  # the check ran on some flags


@pytest.mark.parametrize("command,dest", [("train", "seq_len"), ("lora", "max_seq_length"),
                                          ("perplexity", "sequence_length")])
def test_every_length_spelling_sets_the_commands_length(command, dest):
    parser = parser_of(command)
    for spelling in LENGTH_SPELLINGS:
        assert getattr(parser.parse_args([*REQUIRED[command], spelling, "48"]), dest) == 48, spelling


@pytest.mark.parametrize("command,dest,spellings", [
    ("train", "output", ("--output", "-o", "--out")),
    ("lora", "adapter_path", ("--adapter-path", "--output", "--out")),
    ("fuse", "save_path", ("--save-path", "--output", "--out")),
])  # fmt: skip
def test_output_spellings_set_the_output_folder(command, dest, spellings):
    parser = parser_of(command)
    for spelling in spellings:
        assert getattr(parser.parse_args([*REQUIRED[command], spelling, "somewhere"]), dest) == "somewhere", spelling


def test_mlx_lm_names_come_first_in_the_help():
    """argparse names a value after its first long flag: mlx-lm's spelling for each command."""
    assert parser_of("lora").format_usage().count("--max-seq-length MAX_SEQ_LENGTH") == 1
    assert parser_of("perplexity").format_usage().count("--sequence-length SEQUENCE_LENGTH") == 1
    assert parser_of("fuse").format_usage().count("--save-path SAVE_PATH") == 1


def test_fuse_refuses_an_existing_output_unless_overwrite(stories_hf, tmp_path, capsys):
    from mlx_tfm.loading import load, load_model
    from mlx_tfm.model.lora import apply_lora
    from mlx_tfm.weights.adapters import save_adapters

    model, _ = load_model(stories_hf)
    apply_lora(model, num_layers=1, rank=2)
    save_adapters(tmp_path / "adapters", model, {"fine_tune_type": "lora", "num_layers": 1,
                                                 "lora_parameters": {"rank": 2, "scale": 20.0, "dropout": 0.0}})
    out = tmp_path / "fused"
    out.mkdir()
    (out / "notes.txt").write_text("someone's work")
    argv = ["fuse", "--model", str(stories_hf), "--adapter-path", str(tmp_path / "adapters")]
    assert main([*argv, "--save-path", str(out)]) == 1
    assert capsys.readouterr().err == f"error: {out} already exists (pass --overwrite to replace it)\n"
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert main([*argv, "--out", str(out), "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file()
    load(out)
