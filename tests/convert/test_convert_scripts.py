"""The checkout's convert/ scripts, run as a user runs them (``python convert/<script>.py``):
each one's --help; stories260K from its Hugging Face folder, its llama2.c checkpoint and a
GGUF of it gives the golden text; a converted folder quantizes again; a source of the
wrong kind is one line. And convert/ is never installed as a package of its own."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
import pytest
from fixtures.convert_helpers import greedy, stories_llama2c_tensors, write_stories_gguf
from fixtures.project_builds import ROOT, built_wheel, copy_project

import mlx_tfm

SCRIPTS = ROOT / "convert"
SOURCE_FLAGS = {"from_hf": "--hf-path", "from_gguf": "--gguf-path", "from_llama2c": "--llama2c-path",
                "requantize": "--model"}


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def converted(name: str, *args) -> None:
    done = run_script(name, *args)
    assert done.returncode == 0, done.stderr


def assert_golden(folder, golden) -> None:
    model, tokenizer = mlx_tfm.load(folder)
    ids = greedy(model, golden["prompt_ids"], len(golden["generated_ids"]))
    assert ids == golden["generated_ids"]
    assert tokenizer.decode(ids) == golden["text"]


@pytest.mark.parametrize("name", SOURCE_FLAGS)
def test_each_script_explains_itself(name):
    done = run_script(name, "--help")
    assert done.returncode == 0, done.stderr
    for flag in (SOURCE_FLAGS[name], "--mlx-path", "--q-bits", "--q-group-size", "--dtype"):
        assert flag in done.stdout, flag
    assert f"python convert/{name}.py {SOURCE_FLAGS[name]} " in done.stdout  # its examples


def option_table(parser: argparse.ArgumentParser) -> dict:
    return {tuple(a.option_strings): (a.default, a.choices) for a in parser._actions if a.option_strings}


def test_the_flags_are_mlx_lm_converts():
    """`mlx-tfm convert` and the scripts share one definition of the settings
    (cli/convert.py); it spells and limits each flag mlx_lm.convert also has as mlx_lm does,
    so its recipes carry over."""
    import importlib

    from mlx_tfm.cli import convert as cli_convert

    ours, theirs = argparse.ArgumentParser(), importlib.import_module("mlx_lm.convert").configure_parser()
    cli_convert.add_arguments(ours)
    mlx_lm = {options[-1]: choices for options, (_, choices) in option_table(theirs).items()}
    shared = [options for options in option_table(ours) if any(o in mlx_lm for o in options)]
    assert len(shared) >= 7  # --hf-path, --mlx-path, -q, --q-group-size, --q-bits, --quant-predicate, --dtype, -d
    for options in shared:
        name = next(o for o in options if o in mlx_lm)
        choices = option_table(ours)[options][1]
        if mlx_lm[name] is not None:
            assert list(choices) == list(mlx_lm[name]), name


def test_a_hugging_face_folder_gives_the_golden_text(tmp_path, stories_hf, golden):
    converted("from_hf", "--hf-path", stories_hf, "--mlx-path", tmp_path / "out")
    assert_golden(tmp_path / "out", golden)


def test_a_llama2c_checkpoint_gives_the_golden_text(tmp_path, stories_dir, golden):
    converted("from_llama2c", "--llama2c-path", stories_dir / "stories260K.bin", "--mlx-path", tmp_path / "out")
    assert_golden(tmp_path / "out", golden)


def test_a_gguf_file_gives_the_golden_text(tmp_path, stories_dir, stories_hf, golden):
    tensors, config = stories_llama2c_tensors(stories_hf)
    write_stories_gguf(tensors, config, stories_dir / "tok512.model", tmp_path / "stories.gguf", "F32")
    converted("from_gguf", "--gguf-path", tmp_path / "stories.gguf", "--mlx-path", tmp_path / "out")
    assert_golden(tmp_path / "out", golden)


def test_a_converted_folder_quantizes_again(tmp_path, stories_hf):
    """8-bit groups of 64 -> 4-bit groups of 32: each matrix is MLX's quantization of the
    8-bit folder's dequantized matrix."""
    converted("from_hf", "--hf-path", stories_hf, "--mlx-path", tmp_path / "q8", "-q", "--q-bits", "8")
    converted("requantize", "--model", tmp_path / "q8", "--mlx-path", tmp_path / "q4", "--q-bits", "4",
              "--q-group-size", "32")
    config = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert (config["quantization"]["bits"], config["quantization"]["group_size"]) == (4, 32)
    q8, q4 = (mx.load(str(tmp_path / name / "model.safetensors")) for name in ("q8", "q4"))
    name = "model.layers.0.mlp.gate_proj"
    source = mx.dequantize(q8[f"{name}.weight"], q8[f"{name}.scales"], q8[f"{name}.biases"], group_size=64, bits=8)
    expected = mx.quantize(source, group_size=32, bits=4)
    model, _ = mlx_tfm.load(tmp_path / "q4")
    loaded = dict(tree_flatten(model.parameters()))
    for part, reference in zip(("weight", "scales", "biases"), expected):
        stored = q4[f"{name}.{part}"]
        np.testing.assert_array_equal(np.array(stored), np.array(reference.astype(stored.dtype)))
        assert mx.array_equal(loaded[f"{name}.{part}"], stored)  # and the model runs them


@pytest.mark.parametrize("name,source,message", [
    ("from_gguf", "stories260K/stories260K.bin", "is a llama2.c checkpoint, not a GGUF file"),
    ("from_llama2c", "stories260K-hf", "is a folder, not a llama2.c checkpoint"),
    ("from_hf", "stories260K/stories260K.bin", "is a llama2.c checkpoint, not a folder or Hugging Face repo id"),
    ("requantize", "stories260K/tok512.model", "is not a model file mlx_tfm can read"),
    ("from_gguf", "no-such.gguf", "no-such.gguf does not exist"),
])
def test_a_source_of_another_kind_is_one_line(name, source, message, tmp_path, stories_dir):
    path = stories_dir.parent / source if "/" in source or source.startswith("stories") else tmp_path / source
    done = run_script(name, SOURCE_FLAGS[name], path, "--mlx-path", tmp_path / "out")
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_convert_is_not_packaged(tmp_path):
    """The wheel holds mlx_tfm only: no top-level `convert` package (a generic name that
    would collide in site-packages), nor the scripts."""
    import os

    project = copy_project(tmp_path / "project")
    assert (project / "convert" / "from_hf.py").is_file()
    wheel = built_wheel(project, tmp_path / "wheels", {**os.environ, "MLX_TFM_BUILD_KERNELS": "0"})
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert top_level == {"mlx_tfm", "mlx_tfm-0.1.0.dist-info"}, top_level


def test_the_flags_choices_are_what_the_converter_takes():
    """cli/convert.py spells the choices out (building a parser imports no MLX): they must
    stay the converter's own."""
    from mlx_tfm.cli import convert as cli_convert
    from mlx_tfm.convert import converter
    from mlx_tfm.weights.files import DTYPES
    from mlx_tfm.weights.quantization import QUANT_RECIPES

    assert cli_convert.Q_BITS == converter.Q_BITS and cli_convert.Q_GROUP_SIZES == converter.Q_GROUP_SIZES
    assert cli_convert.DTYPES == tuple(DTYPES) and cli_convert.QUANT_RECIPES == tuple(QUANT_RECIPES)
