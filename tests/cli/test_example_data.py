"""`mlx-tfm example-data`: the example sets the docs train on. What it writes is data in the
formats `mlx-tfm lora` / `mlx-tfm train` and mlx-lm read, taken from the fixtures whose
origin tests/data/SOURCES.md records, with its license beside it; a bad DIR is one line."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import data_path
from mlx_tfm.cli import build_parser, main
from mlx_tfm.cli import example_data
from mlx_tfm.cli.generate import SHIPPED_MODEL


def write(capsys, *argv) -> tuple[int, str, str]:
    code = main(["example-data", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *argv) -> str:
    code, _, err = write(capsys, *argv)
    err = err.strip()
    assert code == 1, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_wikisql_is_mlx_lm_jsonl_taken_from_the_fixture(tmp_path, capsys):
    folder = tmp_path / "wikisql"
    code, out, _ = write(capsys, folder)
    assert code == 0
    assert sorted(p.name for p in folder.iterdir()) == ["LICENSE", "README.md", "test.jsonl", "train.jsonl",
                                                        "valid.jsonl"]
    for split, count in (("train", 500), ("valid", 50), ("test", 50)):
        lines = (folder / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines]
        assert len(records) == count, split
        assert all(set(r) == {"text"} and r["text"].startswith("table: ") and "\nA: SELECT " in r["text"]
                   for r in records), split
        # The first lines of the fixture, unchanged (tests/data/SOURCES.md has its origin).
        fixture = data_path("wikisql", f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        assert lines == fixture[:count], split
        assert re.search(rf"^  {split}\.jsonl +{count} records$", out, re.M), out
    assert "Salesforce Research" in (folder / "LICENSE").read_text() and "Apple Inc." in (folder / "LICENSE").read_text()
    assert "WikiSQL" in (folder / "README.md").read_text()


def test_mlx_lm_reads_the_wikisql_set(tmp_path, capsys):
    from mlx_lm.tuner.datasets import TextDataset, load_local_dataset

    assert write(capsys, tmp_path / "w")[0] == 0
    tokenizer = SimpleNamespace(encode=lambda text: list(text.encode()), eos_token_id=0)
    splits = load_local_dataset(tmp_path / "w", tokenizer, SimpleNamespace())
    assert [type(s) for s in splits] == [TextDataset] * 3
    assert [len(s) for s in splits] == [500, 50, 50]
    tokens, offset = splits[0].process(splits[0][0])
    assert tokens[-1] == 0 and offset == 0


def test_lora_trains_on_the_wikisql_set_with_the_shipped_model(tmp_path, capsys):
    assert write(capsys, tmp_path / "data")[0] == 0
    adapters = tmp_path / "adapters"
    code = main(["lora", "--model", str(SHIPPED_MODEL), "--train", "--data", str(tmp_path / "data"),
                 "--iters", "3", "--batch-size", "2", "--val-batches", "1", "--steps-per-report", "3",
                 "--adapter-path", str(adapters), "--test", "--test-batches", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Iter 3: Train loss" in out and "Test loss" in out
    assert (adapters / "adapters.safetensors").is_file()


def test_train_reads_the_tinyshakespeare_text(tmp_path, capsys):
    folder = tmp_path / "shakespeare"
    code, out, _ = write(capsys, folder, "--name", "tinyshakespeare")
    assert code == 0
    text = (folder / "input.txt").read_text(encoding="utf-8")
    assert data_path("tinyshakespeare", "input.txt").read_text(encoding="utf-8").startswith(text)
    assert text.startswith("First Citizen:\n") and text.endswith("\n") and len(text) == 100_020
    assert re.search(r"^  input\.txt +100,020 characters$", out, re.M), out
    code = main(["train", "--config", "micro", "--tokenizer", "byte", "--data", str(folder / "input.txt"),
                 "--output", str(tmp_path / "model"), "--iters", "2", "--batch-size", "2", "--seq-len", "32",
                 "--steps-per-eval", "0", "--save-every", "100"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "model" / "config.json").is_file()


def test_help_says_what_each_set_writes():
    _, subparsers = build_parser({"example-data": example_data})
    subcommand = subparsers["example-data"]
    text = subcommand.format_help()
    for name in example_data.SETS:
        files = [p.name for p in (example_data.ASSETS / name).iterdir() if p.suffix in (".jsonl", ".txt")]
        assert name in text and all(f in text for f in files), (name, files)


def test_a_non_empty_folder_is_refused_without_overwrite(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    err = one_line_error(capsys, tmp_path)
    assert "not empty" in err and "--overwrite" in err
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_a_file_is_not_a_folder(tmp_path, capsys, where):
    file = tmp_path / "f"
    file.write_text("")
    err = one_line_error(capsys, file if where == "file" else file / "sub")
    assert err == f"error: {file} is a file, not a folder"


def test_overwrite_replaces_the_set_and_keeps_other_files(tmp_path, capsys):
    folder = tmp_path / "data"
    assert write(capsys, folder)[0] == 0
    (folder / "train.jsonl").write_text('{"text": "changed"}\n')
    (folder / "mine.txt").write_text("keep me")
    assert write(capsys, folder, "--overwrite")[0] == 0
    assert (folder / "train.jsonl").read_bytes() == (example_data.ASSETS / "wikisql" / "train.jsonl").read_bytes()
    assert (folder / "mine.txt").read_text() == "keep me"


def test_one_set_per_folder_so_each_keeps_its_license(tmp_path, capsys):
    assert write(capsys, tmp_path / "data")[0] == 0
    err = one_line_error(capsys, tmp_path / "data", "--name", "tinyshakespeare", "--overwrite")
    assert "of the wikisql example set" in err
    assert "WikiSQL" in (tmp_path / "data" / "README.md").read_text()


def test_an_interrupted_write_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """Written whole or not at all: a failure after the first file leaves neither DIR nor a
    temporary beside it."""
    real = Path.write_bytes
    calls = []

    def failing(self, data):
        calls.append(self.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", failing)
    err = one_line_error(capsys, tmp_path / "data")
    assert "no space left" in err
    assert list(tmp_path.iterdir()) == []


def test_what_a_killed_run_left_is_removed(tmp_path, capsys):
    """kill -9 mid-write leaves a hidden temporary named after DIR and the dead writer's
    process id; the next run removes it and says so."""
    dead = 2**22 + 1  # above Linux's largest pid: no such process
    left = tmp_path / f".data.{dead}.x1y2.tmp"
    left.mkdir()
    (left / "train.jsonl").write_text("{")
    code, _, err = write(capsys, tmp_path / "data")
    assert code == 0
    assert f"removed {left}, left by an interrupted run" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
