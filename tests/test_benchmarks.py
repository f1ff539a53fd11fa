"""The benchmarks in examples/benchmarks/: every script starts and explains itself
(``--help`` imports its siblings, as a run does), and their one model builder (models.py)
writes folders mlx_tfm loads, each form holding the weights it was given."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "examples" / "benchmarks"
SCRIPTS = sorted(path.name for path in BENCHMARKS.glob("benchmark_*.py"))
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "tie_word_embeddings": True}


def test_the_benchmarks_are_there():
    assert len(SCRIPTS) == 11, SCRIPTS
    assert not list(BENCHMARKS.parent.glob("benchmark_*.py")), "benchmarks live in examples/benchmarks/"


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_benchmark_explains_itself(script, tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # anywhere: a script finds its siblings by its own folder
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: "), done.stdout


@pytest.fixture(scope="module")
def models():
    """examples/benchmarks/models.py, imported as the scripts import it."""
    spec = importlib.util.spec_from_file_location("benchmark_models", BENCHMARKS / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer_dir(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    models.write_bpe_tokenizer(folder, models.SHAKESPEARE.read_text().splitlines()[:2000], vocab_size=300)
    return folder


def test_random_weights_have_the_shape_and_scale_asked_for(models):
    weights = models.random_weights(TINY_LLAMA, seed=3)
    q = np.array(weights["model.layers.1.self_attn.q_proj.weight"])
    assert q.shape == (64, 64) and abs(q.std() - 0.02) < 0.002 and abs(q.mean()) < 0.002
    np.testing.assert_array_equal(np.array(weights["model.norm.weight"]), np.ones(64))
    again = models.random_weights(TINY_LLAMA, seed=3)
    assert all(mx.array_equal(weights[name], again[name]) for name in weights)  # a seed gives the same model


@pytest.mark.parametrize("form", ["float32", "float16", "8bit", "4bit"])
def test_each_form_holds_the_weights_and_loads(form, models, tokenizer_dir, tmp_path):
    import mlx_tfm
    from mlx.utils import tree_flatten

    weights = models.random_weights(TINY_LLAMA)
    folder = models.write_model(tmp_path / form, TINY_LLAMA, weights, tokenizer_dir, form, group_size=32)
    config = json.loads((folder / "config.json").read_text())
    stored = mx.load(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    original = np.array(weights[f"{name}.weight"])
    if form in ("8bit", "4bit"):
        bits = 8 if form == "8bit" else 4
        assert config["quantization"] == {"group_size": 32, "bits": bits}
        assert stored[f"{name}.scales"].dtype == mx.float32
        values = np.array(mx.dequantize(stored[f"{name}.weight"], stored[f"{name}.scales"], stored[f"{name}.biases"],
                                        group_size=32, bits=bits))
        step = np.abs(np.array(stored[f"{name}.scales"])).reshape(-1, 1)  # one per group of 32
        spread = original.reshape(-1, 32).max(1, keepdims=True) - original.reshape(-1, 32).min(1, keepdims=True)
        # the group's range in 2^bits - 1 steps (MLX widens them a little so an edge falls on the grid)
        assert (step <= 1.1 * spread / (2**bits - 1)).all()
        assert (np.abs(values - original).reshape(-1, 32) <= step).all()  # each value within a step
    else:
        assert config["torch_dtype"] == form and stored[f"{name}.weight"].dtype == getattr(mx, form)
        np.testing.assert_array_equal(np.array(stored[f"{name}.weight"]), original.astype(form))
    model, tokenizer = mlx_tfm.load(folder)
    loaded = dict(tree_flatten(model.parameters()))
    for part in ("weight", "scales", "biases") if form.endswith("bit") else ("weight",):
        assert mx.array_equal(loaded[f"{name}.{part}"], stored[f"{name}.{part}"]), part  # the model runs these
    assert tokenizer.decode(tokenizer.encode("To be, or not", add_special_tokens=False)) == "To be, or not"
