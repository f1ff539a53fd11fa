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


def test_the_benchmarks_are_there_and_documented():
    assert len(SCRIPTS) >= 10, SCRIPTS
    docs = " ".join(page.read_text() for page in (BENCHMARKS.parents[1] / "docs").glob("*.md"))
    undocumented = [script for script in SCRIPTS if script not in docs]
    assert not undocumented, f"no page in docs/ says what {undocumented} measure"
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


def test_the_server_benchmark_runs_the_four_apis_and_their_soak_at_toy_size(tmp_path):
    """--part apis and --part soak-apis on the toy model for a few seconds: every API makes
    tokens, no valid request fails, outputs agree, malformed bodies get 400s, no 5xx."""
    command = [sys.executable, str(BENCHMARKS / "benchmark_server.py"), "--toy", "--folder", str(tmp_path / "models"),
               "--part", "apis,api-costs,soak-apis", "--api-clients", "8", "--rounds", "1", "--prompt-tokens", "16",
               "--max-tokens", "6", "--seconds", "3", "--soak-clients", "8", "--soak-tokens", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    by_api = next(line for line in out.splitlines() if "mixed rounds by API:" in line)
    for api in ("chat", "responses", "ollama", "anthropic"):  # 2 clients each, all 6 tokens
        assert f"{api} 12 tokens (0 failed)" in by_api, out
    rows = [line for line in out.splitlines()  # the two summary rows, not the per-round lines
            if ("4 APIs mixed" in line or "chat only" in line) and not line.strip().startswith("round")]
    assert len(rows) == 2 and not any("failed" in row for row in rows), out  # a row names its failed requests
    assert "mixed / chat-only tok/s:" in out and "failed:" not in out, out
    costs = next(line for line in out.splitlines() if "per token (server CPU, wall):" in line)
    for api in ("chat", "responses", "ollama", "anthropic"):  # each API's own cost, one request at a time
        assert f" {api} " in costs, costs
    cpu = next(line for line in out.splitlines() if "server CPU per token:" in line)
    assert float(cpu.split("chat-only ")[1].split(" ms")[0]) > 0, cpu  # the server's CPU time was read
    soak = next(line for line in out.splitlines() if line.strip().startswith("valid ") and "server_errors" in line)
    counts = dict(part.rsplit(" ", 1) for part in soak.strip().split(", "))
    assert counts["failed"] == counts["mixed_up"] == counts["malformed_wrong"] == counts["server_errors"] == "0", soak
    assert int(counts["valid"]) > 0 and int(counts["malformed"]) > 0 and counts["server alive"] == "True", soak
    valid = next(line for line in out.splitlines() if "valid requests by API:" in line)
    streamed = dict(part.rsplit(" ", 1) for part in valid.split("streamed tokens by API: ")[1].split(", "))
    assert set(streamed) == {"chat", "responses", "ollama", "anthropic"} and all(int(v) > 0 for v in streamed.values()), valid
    assert "resident memory" in out, out


def toy_vision_run(tmp_path, family: str, decode_tokens: int) -> str:
    """benchmark_vision.py --toy for ``family``: its stdout, after checking that every row has
    its four positive figures, both libraries in both forms."""
    command = [sys.executable, str(BENCHMARKS / "benchmark_vision.py"), "--toy", "--family", family,
               "--folder", str(tmp_path / "models"), "--repeats", "1", "--decode-tokens", str(decode_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(f"{family}-")]
    assert [(row[0], row[1]) for row in rows] == [(f"{family}-{form}", library) for form in ("float32", "4bit")
                                                  for library in ("mlx_tfm", "mlx-vlm")], done.stdout
    assert all(float(value) > 0 for row in rows for value in row[2:]), done.stdout
    assert done.stdout.count(" ratio ") == 2, done.stdout
    return done.stdout


def test_the_vision_benchmark_times_both_libraries_at_toy_size(tmp_path):
    """benchmark_vision.py --toy: both libraries read the same folders in child processes;
    every row has its four figures and each form its ratio row."""
    toy_vision_run(tmp_path, "smolvlm", 4)


def test_the_vision_benchmark_runs_qwen2_5_vl_in_both_libraries_with_the_same_tokens(tmp_path):
    """benchmark_vision.py --toy --family qwen2_5_vl: mlx-vlm runs its own conversion
    (mlx_vlm.convert) of the transformers checkpoint ours converts, windowed and full-attention
    tower layers both, and the two libraries' greedy tokens agree in float32 and 4-bit."""
    out = toy_vision_run(tmp_path, "qwen2_5_vl", 8)
    assert (tmp_path / "models" / "toy" / "qwen2_5_vl-mlx-vlm-4bit" / "model.safetensors").is_file()
    assert out.count("greedy tokens: the same (9)") == 2, out


def test_a_real_size_checkpoint_is_written_in_shards_and_loads_strictly(models, tokenizer_dir, tmp_path):
    """write_random_checkpoint: every weight of the shape, in float16, spread over shards of
    the size asked for, listed in the index; mlx_tfm loads the folder strictly."""
    import mlx_tfm
    from safetensors.numpy import load_file

    config = {**models.LLAMA_3_1_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
    folder = models.write_random_checkpoint(tmp_path / "model", config, tokenizer_dir, shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    tensors = {name: value for shard in shards for name, value in load_file(str(shard)).items()}
    assert set(tensors) == set(index["weight_map"]) == set(models.parameter_shapes(config))
    assert "lm_head.weight" in tensors  # untied, as Llama 3.1
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for shard in shards:  # one tensor may exceed the size alone; two never do
        members = [t for n, t in tensors.items() if index["weight_map"][n] == shard.name]
        assert len(members) == 1 or sum(t.nbytes for t in members) <= 40_000
    down = tensors["model.layers.1.mlp.down_proj.weight"]
    assert down.dtype == np.float16 and down.shape == (64, 128) and abs(down.astype(np.float32).std() - 0.02) < 0.002
    np.testing.assert_array_equal(tensors["model.layers.0.input_layernorm.weight"], np.ones(64, np.float16))
    model, _ = mlx_tfm.load(folder)  # strict: a missing, extra or mis-shaped weight fails here
    assert model.args.hidden_size == 64 and json.loads((folder / "config.json").read_text())["torch_dtype"] == "float16"


@pytest.mark.parametrize("split,vocab_size", [("smollm", 512), ("llama-bpe", 24000)])
def test_a_sized_bpe_tokenizer_has_the_vocabulary_and_split_llama_cpp_needs(models, split, vocab_size, tmp_path):
    """Exactly vocab_size ids (past what tinyshakespeare's merges give, ~21.5k, too), each
    merge making a piece of the vocabulary, and the GGUF export naming its split as asked."""
    from tokenizers import Tokenizer

    from mlx_tfm.convert.gguf_export import pre_tokenizer_name

    models.write_sized_bpe_tokenizer(tmp_path, vocab_size, split)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(vocab_size))
    assert all(left + right in vocab for left, right in spec["model"]["merges"])
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == vocab_size and pre_tokenizer_name(tokenizer) == split
    assert tokenizer.decode(tokenizer.encode("To be, or not 2024").ids) == "To be, or not 2024"


def test_the_real_sizes_benchmark_measures_the_three_libraries_at_toy_size(tmp_path):
    """--toy: the 8B's recipe (GQA, untied head, Llama 3 RoPE scaling) at hidden 64, 4-bit:
    ours and mlx-lm on one converted folder, llama.cpp on our Q4_0 GGUF, each in a process
    of its own; the markdown row holds all three, its ratios are the quotients of its
    figures, and the work folder is gone after (no --keep). 520 prompt tokens: past
    llama.cpp's batch of 512, where llama-cpp-python keeps no logits of its own."""
    command = [sys.executable, str(BENCHMARKS / "benchmark_real_sizes.py"), "--toy", "--sizes", "8b", "--formats",
               "4bit", "--prompt-tokens", "520", "--decode-tokens", "4", "--repeats", "1", "--markdown",
               "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed" not in done.stdout, done.stdout
    help_text = subprocess.run([sys.executable, "-m", "mlx_tfm.convert", "--help"], capture_output=True, text=True).stdout
    has_q4_k_m = "q4_k_m" in help_text
    assert ("skipping llama.cpp Q4_K_M" in done.stdout) != has_q4_k_m, done.stdout
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| 8b | 4bit")]
    assert [row[1] for row in rows] == ["4bit (Q4_0)", *(["4bit (Q4_K_M)"] if has_q4_k_m else [])], done.stdout
    n_tokens, prompt, decode, peak, vs_llama_cpp, vs_mlx_lm = rows[0][2:]
    prompt_tps, decode_tps, peak_gb = ([float(v) for v in cell.split(" / ")] for cell in (prompt, decode, peak))
    assert n_tokens == "520" and all(v > 0 for v in prompt_tps + decode_tps + peak_gb), rows[0]
    for ratio, theirs in ((vs_llama_cpp, 1), (vs_mlx_lm, 2)):
        prompt_ratio, decode_ratio = (float(r.rstrip("x")) for r in ratio.strip(" |").split(", "))
        assert prompt_ratio == pytest.approx(prompt_tps[0] / prompt_tps[theirs], rel=0.05, abs=0.01), rows[0]
        assert decode_ratio == pytest.approx(decode_tps[0] / decode_tps[theirs], rel=0.05, abs=0.01), rows[0]
    assert not (tmp_path / "work" / "toy" / "8b").exists()


def test_the_real_sizes_benchmark_refuses_a_disk_too_small_before_writing(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its siblings
    spec = importlib.util.spec_from_file_location("benchmark_real_sizes", BENCHMARKS / "benchmark_real_sizes.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    huge = {**benchmark.LLAMA_3_1_8B, "vocab_size": 10**9}  # a 4,096-wide embedding of a billion rows: 16 TB
    with pytest.raises(SystemExit, match=r"has \d+ GB free, these formats need \d+ GB"):
        benchmark.check_room(tmp_path / "work", huge, ["4bit"])
    assert not list((tmp_path / "work").iterdir())  # nothing written
    benchmark.check_room(tmp_path / "work", benchmark.TOY["8b"], ["4bit", "8bit", "16bit"])  # a toy fits
