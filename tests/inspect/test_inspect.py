"""`mlx-tfm inspect`: a model's anatomy checked against references computed apart from it:
the seed's worked numbers, the tensors as the safetensors files store them, the published
size of stories260K, MLX's own quantized layout, a measured KV cache, the model's own
logits and attention output, and a LoRA update computed in numpy."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures.convert_helpers import stories_llama2c_tensors, write_stories_gguf
from fixtures.model_folders import tiny_llama_config, write_model_folder
from fixtures.variants import BASE, TOKENS, VARIANTS, build
from mlx.utils import tree_flatten
from safetensors.numpy import load_file

import mlx_tfm
import mlx_tfm.model.attention
from mlx_tfm.cli import main
from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.inspect import architecture, compare, parts, stream
from mlx_tfm.loading import load_model
from mlx_tfm.model.transformer import Model, TransformerBlock
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.lora import LoRALinear, apply_lora, fuse_adapters
from mlx_tfm.weights.files import save_model_folder, tokenizer_files_of

QUIET = dict(log=lambda *_: None)
ORIGINAL_ATTENTION = mlx_tfm.model.attention.attention  # tracing swaps it, then must put it back
PROMPT = "Once upon a time, there was a little girl named Lily."
STORIES_WEIGHTS = 260_032  # SOURCES.md: 64*512 + 5*(2*64 + 2*64*64 + 2*64*32 + 3*64*172) + 64


def inspect_json(capsys, *argv) -> dict:
    code = main(["inspect", *map(str, argv), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def inspect_text(capsys, *argv) -> str:
    code = main(["inspect", *map(str, argv)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def inspect_error(capsys, *argv) -> str:
    code = main(["inspect", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err.removeprefix("error: ")


@pytest.fixture(scope="module")
def stories(stories_hf):
    model, _ = load_model(stories_hf)
    return model


@pytest.fixture(scope="module")
def tokenizer(stories_hf):
    _, tokenizer = mlx_tfm.load(stories_hf)
    return tokenizer


# -- parameters by part ---------------------------------------------------------------------


def test_d512_model_reproduces_the_seed_budget(tmp_path, capsys):
    """The seed (000): W^Q, W^K, W^V, W^O are 512 x 512 = 262,144 each, 4d² = 1,048,576 in
    all; W_1 and W_2 are 512 x 2048 = 1,048,576 each, 8d² = 2,097,152; the FFN is ~67%."""
    config = tiny_llama_config(hidden_size=512, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=8,
                               num_key_value_heads=8, vocab_size=10, hidden_act="relu", ffn_gated=False)
    folder = write_model_folder(tmp_path / "seed", config, {})
    report = inspect_json(capsys, "--model", folder)["anatomy"]
    rows = {r["name"]: r["parameters"] for r in report["parameters"]["rows"]}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert rows[f"layers.*.self_attn.{name}"] == 262_144
    assert rows["layers.*.mlp.up_proj"] == rows["layers.*.mlp.down_proj"] == 1_048_576
    [block] = report["blocks"]["layers"]
    assert block["attention"] == 1_048_576 and block["ffn"] == 2_097_152
    assert f"{100 * block['ffn_share']:.1f}%" == "66.7%"
    text = inspect_text(capsys, "--model", folder)
    assert "1,048,576  2,097,152" in text and "1 : 2.00" in text and "66.7%" in text
    assert "FFN: two matrices with relu between (not gated)" in text


def expected_from_file(path) -> tuple[int, int]:
    """(logical weights, bytes) of a safetensors file, counted from its tensors alone: a
    quantized X.weight stands for rows x groups x group size weights, where the groups
    are X.scales' columns and the group size is the packed width over the groups."""
    tensors = load_file(path)
    total = 0
    for name, tensor in tensors.items():
        base = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".scales" in tensors:
            continue
        if name.endswith(".weight") and f"{base}.scales" in tensors:
            total += tensor.shape[0] * tensors[f"{base}.scales"].shape[1] * config_group_size(path)
        else:
            total += tensor.size
    return total, sum(t.nbytes for t in tensors.values())


def config_group_size(weights_path) -> int:
    return json.loads((weights_path.parent / "config.json").read_text())["quantization"]["group_size"]


def test_stories_totals_equal_the_stored_tensors(stories_hf, capsys):
    report = inspect_json(capsys, "--model", stories_hf)["anatomy"]
    weights, nbytes = expected_from_file(stories_hf / "model.safetensors")
    assert report["parameters"]["total"] == weights == STORIES_WEIGHTS
    assert report["memory_bytes"] == nbytes == 4 * STORIES_WEIGHTS
    disk = report["disk"]
    assert disk["file_bytes"] == (stories_hf / "model.safetensors").stat().st_size
    assert disk["tensor_bytes"] == nbytes and disk["not_loaded_bytes"] == 0
    assert [r["disk_bytes"] for r in report["parameters"]["rows"]] == [r["bytes"] for r in report["parameters"]["rows"]]
    assert report["parameters"]["head"].startswith("tied to model.embed_tokens")  # counted once


@pytest.mark.parametrize("bits, group_size", [(8, 32), (4, 64)])
def test_quantized_copy_counts_logical_weights_and_stored_bytes(bits, group_size, stories_hf, tmp_path, capsys):
    folder = convert(stories_hf, tmp_path / "q", quantize=True, q_bits=bits, q_group_size=group_size, **QUIET)
    report = inspect_json(capsys, "--model", folder)["anatomy"]
    weights, nbytes = expected_from_file(folder / "model.safetensors")
    assert report["parameters"]["total"] == weights == STORIES_WEIGHTS
    assert report["memory_bytes"] == nbytes < 4 * STORIES_WEIGHTS
    assert report["disk"]["tensor_bytes"] == nbytes
    stored = {r["name"]: r["stored_as"] for r in report["parameters"]["rows"]}
    assert stored["layers.*.self_attn.q_proj"] == f"{bits}-bit, group {group_size}"
    assert stored["layers.*.input_layernorm"] == "float32"


def test_llama2c_file_total_and_file_size(stories_dir, capsys):
    """llama2.c's legacy file: a 28-byte header, the 260,032 float32 weights, then the
    freq_cis tables (2 x 512 x 4 floats) that runtimes skip."""
    path = stories_dir / "stories260K.bin"
    report = inspect_json(capsys, "--model", path)["anatomy"]
    assert report["parameters"]["total"] == STORIES_WEIGHTS
    assert report["memory_bytes"] == 4 * STORIES_WEIGHTS
    assert report["disk"]["file_bytes"] == path.stat().st_size == 28 + 4 * STORIES_WEIGHTS + 4 * 2 * 512 * 4
    assert report["disk"]["tensor_bytes"] is None  # read through the converter


def test_gguf_q8_counts_logical_weights(stories_dir, stories_hf, tmp_path, capsys):
    tensors, config = stories_llama2c_tensors(stories_hf)
    path = tmp_path / "stories.gguf"
    write_stories_gguf(tensors, config, stories_dir / "tok512.model", path, "Q8_0")
    report = inspect_json(capsys, "--model", path)["anatomy"]
    assert report["parameters"]["total"] == STORIES_WEIGHTS
    assert report["disk"]["file_bytes"] == path.stat().st_size
    stored = {r["name"]: r["stored_as"] for r in report["parameters"]["rows"]}
    assert stored["layers.*.self_attn.q_proj"] == "8-bit, group 32"


def test_a_new_part_type_is_reported_under_its_own_name():
    """Experts (a stacked (E, out, in) weight) and a router nobody told this module about."""
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict({**BASE, "num_key_value_heads": 2}))
    experts = nn.Module()
    experts.gate_proj = mx.zeros((4, 80, 48))
    model.layers[0].mlp.experts = experts
    model.layers[0].router = nn.Linear(48, 4, bias=False)
    found = {p.name: p for p in parts.model_parts(model)}
    assert found["model.layers.0.mlp.experts"].kind == "ffn"
    stacked = found["model.layers.0.mlp.experts"]
    assert stacked.parameters == stacked.matrix_parameters == 4 * 80 * 48
    assert found["model.layers.0.router"].kind == "other"
    rows = {r.name: r for r in parts.part_rows(list(found.values()))}
    assert rows["layers.*.mlp.experts"].blocks == 1 and rows["layers.*.router"].parameters == 48 * 4
    first, second = parts.block_shares(list(found.values()))
    assert first.ffn - second.ffn == 4 * 80 * 48 and first.other - second.other == 48 * 4


def test_architecture_in_words_names_what_differs_from_a_plain_llama():
    words = architecture.describe_architecture(build("gemma2-style").args)
    text = " | ".join(words)
    for fragment in ("sandwich norm", "attention scores soft-capped at 50", "logits soft-capped at 30",
                     "sliding-window attention (3 positions) in 1 of 2 layers", "GQA: 6 query heads share 3",
                     "GeGLU (tanh GELU)", "embeddings scaled by 6.928", "attention scale 0.2"):
        assert fragment in text, text
    assert text.count("sliding-window") == 1  # sliding_window and layer_types: one phrase
    assert architecture.describe_architecture(ModelArgs.from_dict(BASE)) == []


def test_flops_per_token_follow_the_formula():
    """MHA, two-matrix FFN: 2 x (L x 12d² + V d) + 4 L d T (q k^T and the sum over V)."""
    d, L, V = 64, 3, 100
    args = ModelArgs.from_dict(dict(vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=4,
                                    intermediate_size=4 * d, hidden_act="relu", ffn_gated=False))
    found = parts.model_parts(Model(args))
    for T in (1, 7, 100):
        assert architecture.flops_per_token(args, found, T) == 2 * (L * 12 * d * d + V * d) + 4 * L * d * T


# -- the KV cache -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype, nbytes", [(mx.float16, 2), (mx.float32, 4)])
def test_kv_bytes_per_token_equal_a_measured_cache_growth(stories_hf, dtype, nbytes):
    model, _ = load_model(stories_hf, dtype=dtype)
    cache = model.make_cache()

    def measured():  # (bytes held, positions allocated) over all layers
        return sum(c.nbytes for c in cache), cache[0].keys.shape[2]

    model(mx.array([[1] * 3]), cache=cache)
    bytes_before, positions_before = measured()
    model(mx.array([[1] * 300]), cache=cache)  # past the first allocation: the cache grows
    bytes_after, positions_after = measured()
    assert positions_after > positions_before
    per_position = (bytes_after - bytes_before) / (positions_after - positions_before)
    assert architecture.kv_cache_bytes(model.args, 512, dtype_bytes=nbytes)["per_token"] == per_position


def test_kv_bytes_at_a_context_count_sliding_windows():
    mx.random.seed(0)
    args = ModelArgs.from_dict({**BASE, "num_key_value_heads": 2, "sliding_window": 4,
                                "layer_types": ["sliding_attention", "full_attention"]})
    model = Model(args)
    cache = model.make_cache()
    for layer_cache in cache:
        layer_cache.reserve(20)
    model(mx.array([list(range(20))]), cache=cache)
    measured = sum(c.nbytes for c in cache)
    assert architecture.kv_cache_bytes(args, 20, dtype_bytes=4)["at_context"] == measured
    assert measured == 2 * 2 * 8 * 4 * (4 + 20)  # k and v, 2 KV heads of 8, float32, window + full


@pytest.mark.parametrize("head_dim, group", [(64, 64), (128, 128), (96, 32)])  # the default group: the largest that divides
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_bytes_follow_mlx_affine_layout(head_dim, group, bits):
    args = ModelArgs.from_dict(dict(vocab_size=10, hidden_size=256, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=head_dim, intermediate_size=64))
    vectors = mx.zeros((args.num_key_value_heads, head_dim), dtype=mx.float16)  # one position's keys
    stored = sum(a.nbytes for a in mx.quantize(vectors, group_size=group, bits=bits))
    figures = architecture.kv_cache_bytes(args, 1000, dtype_bytes=None, bits=bits)
    assert figures["per_token"] == args.num_hidden_layers * 2 * stored
    assert figures["at_context"] == 1000 * figures["per_token"]


def test_quantized_kv_bytes_need_a_group_size_that_fits():
    args = ModelArgs.from_dict({**BASE})  # head_dim 8
    assert architecture.kv_cache_bytes(args, 10, dtype_bytes=None, bits=4) == {"per_token": None, "at_context": None}


# -- the residual stream, attention maps and the logit lens -----------------------------


def test_logit_lens_last_layer_is_the_models_own_logits(stories, tokenizer):
    ids = tokenizer.encode(PROMPT)
    recorded = stream.trace(stories, ids)
    logits = stories(mx.array([ids]))[0]  # a forward pass of its own, nothing recorded
    np.testing.assert_allclose(np.array(stream.lens_logits(stories, recorded.stream[-1])), np.array(logits), atol=1e-6)
    np.testing.assert_allclose(np.array(recorded.logits), np.array(logits), atol=1e-6)
    lens = stream.logit_lens(stories, recorded)
    assert lens.top_ids[-1].tolist() == np.argmax(np.array(logits), axis=-1).tolist()
    np.testing.assert_allclose(np.array(recorded.stream[0]), np.array(stories.model.embed_tokens(mx.array(ids))))
    assert lens.top_ids.shape == (len(stories.layers) + 1, len(ids))
    # the model is itself again
    assert all(type(layer) is TransformerBlock for layer in stories.layers)
    assert mlx_tfm.model.attention.attention is ORIGINAL_ATTENTION


@pytest.mark.parametrize("variant", ["llama-gqa", "post-norm-relu-sinusoidal", "gemma2-style", "qwen3-qk-norm",
                                     "gpt2-style-mqa", "rope-interleaved"])
def test_traced_stream_and_attention_weights_are_the_models(variant):
    model = build(variant)
    ids = TOKENS[0].tolist()
    recorded = stream.trace(model, ids)
    np.testing.assert_allclose(np.array(stream.lens_logits(model, recorded.stream[-1])), np.array(model(TOKENS)[0]),
                               atol=1e-5)
    for call in recorded.attention:
        weights = stream.weights_of(call)  # (1, heads, L, L)
        np.testing.assert_allclose(np.array(weights.sum(-1)), 1.0, atol=1e-5)
        values = mx.repeat(call.values, call.queries.shape[1] // call.values.shape[1], axis=1)
        reference = mlx_tfm.model.attention.attention(call.queries, call.keys, call.values, call.scale, call.mask,
                                                call.softcap)
        np.testing.assert_allclose(np.array(weights @ values), np.array(reference), atol=2e-5)
    if variant == "gemma2-style":  # layer 0 slides over 3 positions
        weights = np.array(stream.weights_of(recorded.attention[0])[0])
        i, j = np.indices(weights.shape[1:])
        assert np.all(weights[:, (i - j) >= VARIANTS[variant]["sliding_window"]] == 0)


def test_recomputed_attention_reproduces_the_attention_output(stories):
    """The fused kernel never shows its weights: recomputed, weights @ V through o_proj
    must be the attention module's own output."""
    x = mx.random.normal((1, 9, stories.args.hidden_size))
    attn = stories.layers[2].self_attn
    weights = stream.attention_weights(attn, x)  # (heads, L, L)
    assert np.allclose(np.array(weights.sum(-1)), 1.0, atol=1e-5)
    assert np.all(np.triu(np.array(weights), k=1) == 0)  # nothing from the future
    values = attn.v_proj(x).reshape(1, 9, attn.n_kv_heads, attn.head_dim).transpose(0, 2, 1, 3)
    values = mx.repeat(values, attn.n_heads // attn.n_kv_heads, axis=1)[0]  # (heads, L, head_dim)
    out = attn.o_proj((weights @ values).transpose(1, 0, 2).reshape(1, 9, -1))
    np.testing.assert_allclose(np.array(out), np.array(attn(x, "causal")), atol=1e-5)


def test_prompt_pictures_and_tables(stories_hf, stories, tokenizer, tmp_path, capsys):
    out = tmp_path / "pictures"
    report = inspect_json(capsys, "--model", stories_hf, "--prompt", PROMPT, "--out", out)["stream"]
    ids = tokenizer.encode(PROMPT)
    assert report["token_ids"] == ids and report["tokens"][1] == " Once"
    recorded = stream.trace(stories, ids)
    expected = [np.linalg.norm(np.array(state), axis=-1) for state in recorded.stream]
    np.testing.assert_allclose(np.array(report["residual_norms"]), np.array(expected), rtol=1e-5)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"attention_layer_{i:02d}.png" for i in range(5)]
                           + ["attention_layers.png", "residual_norms.png", "logit_lens.png"])
    for path in out.iterdir():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = inspect_text(capsys, "--model", stories_hf, "--prompt", PROMPT)
    assert "logit lens" in text and "residual stream norm" in text


# -- comparing two models ------------------------------------------------------------------


def test_compare_with_a_lora_fused_copy_changes_only_the_adapted_layers(stories_hf, tmp_path, capsys):
    model, config = load_model(stories_hf)
    base = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    apply_lora(model, num_layers=2, keys=["self_attn.q_proj", "mlp.down_proj"], rank=4, scale=2.0)
    mx.random.seed(1)
    expected = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module.lora_b = 0.05 * mx.random.normal(module.lora_b.shape)
            delta = module.scale * np.array(module.lora_b).T @ np.array(module.lora_a).T  # (out, in), numpy
            weight = base[f"{name}.weight"]
            expected[f"{name}.weight"] = np.linalg.norm(delta) / np.linalg.norm(weight)
    fuse_adapters(model)
    fused = tmp_path / "fused"
    save_model_folder(fused, config, dict(tree_flatten(model.parameters())), tokenizer_files_of(stories_hf))
    report = inspect_json(capsys, "--model", stories_hf, "--compare", fused)["compare"]
    changed = {t["name"]: t["relative"] for t in report["tensors"] if t["change"] > 0}
    assert sorted(changed) == sorted(expected) == [
        f"model.layers.{i}.{k}.weight" for i in (3, 4) for k in ("mlp.down_proj", "self_attn.q_proj")]
    for name, relative in changed.items():
        assert relative == pytest.approx(expected[name], rel=1e-4)
    by_layer = {g["layer"]: g["relative"] for g in report["layers"]}
    assert by_layer[0] == by_layer[1] == by_layer[2] == by_layer[None] == 0 < by_layer[3]
    text = inspect_text(capsys, "--model", stories_hf, "--compare", fused, "--out", tmp_path / "pics")
    assert "4 of 47 tensors differ" in text
    assert (tmp_path / "pics" / "compare.png").read_bytes()[:4] == b"\x89PNG"


def numpy_dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine layout, unpacked here: little-endian bits-wide values in each uint32,
    w = scale * q + bias per group."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    q = ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1).astype(np.float32)
    group = q.shape[1] // scales.shape[1]
    return (q.reshape(q.shape[0], -1, group) * scales[..., None] + biases[..., None]).reshape(q.shape)


def test_compare_with_a_quantized_copy_shows_its_rounding(stories_hf, tmp_path):
    folder = convert(stories_hf, tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32, **QUIET)
    stored, original = load_file(folder / "model.safetensors"), load_file(stories_hf / "model.safetensors")
    a, _ = load_model(stories_hf)
    b, _ = load_model(folder)
    changes = {c.name: c for c in compare.compare_models(a, b)}
    assert set(changes) == set(original)
    for name, weight in original.items():
        base = name.removesuffix(".weight")
        if f"{base}.scales" in stored:
            dequantized = numpy_dequantize(stored[name], stored[f"{base}.scales"], stored[f"{base}.biases"], 8)
            expected = np.linalg.norm(dequantized - weight) / np.linalg.norm(weight)
            assert 0 < changes[name].relative == pytest.approx(expected, rel=1e-4)
        else:  # kept in float32: norms, and down_proj (172 columns fit no group)
            assert changes[name].change == 0


def test_compare_names_the_first_mismatch(stories_hf, tmp_path, capsys):
    tokenizer = {"tokenizer.model": stories_hf / "tokenizer.model"}
    narrow = write_model_folder(tmp_path / "narrow", tiny_llama_config(vocab_size=512), tokenizer)
    err = inspect_error(capsys, "--model", stories_hf, "--compare", narrow)
    assert err == (f"cannot compare the two models: model.embed_tokens.weight is (512, 64) in {stories_hf} "
                   f"but (512, 32) in {narrow}")
    config = json.loads((stories_hf / "config.json").read_text())
    deeper = write_model_folder(tmp_path / "deeper", {**config, "num_hidden_layers": 6}, tokenizer)
    err = inspect_error(capsys, "--model", stories_hf, "--compare", deeper)
    assert err.startswith("cannot compare the two models: model.layers.5.") and err.endswith(
        f"is in {deeper} but not in {stories_hf}")


# -- bad input ----------------------------------------------------------------------------


def bad_sources(tmp_path, stories_hf, stories_dir) -> dict:
    """Sources load() refuses, each built here."""
    empty = tmp_path / "empty"
    empty.mkdir()
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    (gptq / "model.safetensors").write_bytes((stories_hf / "model.safetensors").read_bytes())
    config = json.loads((stories_hf / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                                                    "group_size": 128}}))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "model.safetensors").write_bytes((stories_hf / "model.safetensors").read_bytes())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-family"}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    (corrupt / "config.json").write_text(json.dumps(config))
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes((stories_dir / "stories260K.bin").read_bytes()[:-1000])
    (tmp_path / "tok512.model").write_bytes((stories_dir / "tok512.model").read_bytes())
    return {"missing": tmp_path / "nowhere", "empty": empty, "gptq": gptq, "unknown": unknown, "corrupt": corrupt,
            "truncated": truncated}


@pytest.mark.parametrize("kind", ["missing", "empty", "gptq", "unknown", "corrupt", "truncated"])
def test_sources_load_refuses_are_refused_the_same_way(kind, stories_hf, stories_dir, tmp_path, capsys):
    source = bad_sources(tmp_path, stories_hf, stories_dir)[kind]
    with pytest.raises(UserError) as refused:
        mlx_tfm.load(source)
    assert inspect_error(capsys, "--model", source) == str(refused.value)
    assert inspect_error(capsys, "--model", stories_hf, "--compare", source) == str(refused.value)


@pytest.mark.parametrize("flags, message", [
    (["--context", "0"], "--context must be a positive number of tokens"),
    (["--out", "pictures"], "--out holds the pictures of --prompt or --compare"),
    (["--prompt", "Once upon a time " * 200], "the prompt is 801 tokens but the model's context is 512"),
])
def test_bad_flags(flags, message, stories_hf, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in inspect_error(capsys, "--model", stories_hf, *flags)


def test_out_that_is_a_file_and_a_tokenizer_that_does_not_fit(stories_hf, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert "is a file, not a folder" in inspect_error(capsys, "--model", stories_hf, "--prompt", "hi", "--out",
                                                      tmp_path / "file")
    small = write_model_folder(tmp_path / "m", tiny_llama_config(vocab_size=256),
                               {"tokenizer.model": stories_hf / "tokenizer.model"})
    err = inspect_error(capsys, "--model", small, "--prompt", "hi")
    assert "tokenizer has 512 tokens but the model only 256" in err
