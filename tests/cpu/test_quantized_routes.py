"""The CPU-fast linear layers (mlx_tfm/cpu/linear.py) compute what MLX's layers compute, and
float32, float16 and quantized folders load with them and generate through them."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_tfm import load, stream_generate
from mlx_tfm.cpu import linear as cpu_linear
from mlx_tfm.cpu.linear import Embedding, Linear, QuantizedEmbedding, QuantizedLinear


@pytest.mark.parametrize("rows", [1, 3, 40, 100])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_dense_route_equals_the_quantized_kernel(rows, dtype):
    mx.random.seed(0)
    linear = nn.Linear(128, 96, bias=True)
    linear.update({"weight": linear.weight.astype(dtype), "bias": linear.bias.astype(dtype)})
    ours = QuantizedLinear.from_linear(linear, group_size=64, bits=4)
    reference = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=4)
    x = mx.random.normal((1, rows, 128)).astype(dtype)
    expected = np.array(reference(x).astype(mx.float32))
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert np.allclose(np.array(ours(x).astype(mx.float32)), expected, atol=tolerance, rtol=tolerance)
    assert ours(x).dtype == dtype
    assert ours.dense_is_faster(x) == (rows >= ours.dense_from())


@pytest.mark.parametrize("streams", [1, 2, 3])
@pytest.mark.parametrize("scales_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_quantized_product_split_over_cpu_streams_equals_the_kernel(streams, scales_dtype, monkeypatch):
    """Every output row comes from exactly one stream's slice, for any number of streams
    (97 rows do not divide evenly), and half-precision scales give the kernel's answer."""
    monkeypatch.setattr(cpu_linear, "extra_cpu_streams", lambda: tuple(mx.new_stream(mx.cpu) for _ in range(streams - 1)))
    mx.random.seed(1)
    reference = nn.QuantizedLinear.from_linear(nn.Linear(128, 97, bias=True), group_size=64, bits=4)
    reference.update({"scales": reference.scales.astype(scales_dtype), "biases": reference.biases.astype(scales_dtype)})
    ours = QuantizedLinear(128, 97, bias=True, group_size=64, bits=4)
    ours.update(reference.parameters())
    x = mx.random.normal((1, 1, 128))
    expected = reference.update({"scales": reference.scales.astype(mx.float32), "biases": reference.biases.astype(mx.float32)})(x)
    assert np.allclose(np.array(ours(x)), np.array(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scales_dtype", [mx.float32, mx.float16])
def test_quantized_tied_head_equals_mlx_as_linear(scales_dtype, monkeypatch):
    monkeypatch.setattr(cpu_linear, "extra_cpu_streams", lambda: (mx.new_stream(mx.cpu),))
    mx.random.seed(2)
    embedding = nn.Embedding(301, 64)
    reference = nn.QuantizedEmbedding.from_embedding(embedding, group_size=32, bits=4)
    ours = QuantizedEmbedding.from_embedding(embedding, group_size=32, bits=4)
    assert mx.array_equal(ours.weight, reference.weight)
    ours.update({"scales": ours.scales.astype(scales_dtype), "biases": ours.biases.astype(scales_dtype)})
    x = mx.random.normal((1, 1, 64)).astype(scales_dtype)
    head = ours.as_linear(x)
    assert head.dtype == scales_dtype and head.shape == (1, 1, 301)
    tolerance = 1e-5 if scales_dtype == mx.float32 else 2e-2
    expected = np.array(reference.as_linear(x.astype(mx.float32)))
    assert np.allclose(np.array(head.astype(mx.float32)), expected, atol=tolerance, rtol=tolerance)


def test_quantized_folder_loads_with_fast_layers_and_generates(stories_hf, tmp_path, monkeypatch):
    model, tokenizer = load(stories_hf)
    # 8 bits: close enough to keep the greedy text; down_proj (172 inputs) stays float
    nn.quantize(model, group_size=32, bits=8,
                class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.shape[-1] % 32 == 0)
    folder = tmp_path / "q8"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((stories_hf / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 8}}))
    (folder / "tokenizer.model").write_bytes((stories_hf / "tokenizer.model").read_bytes())
    quantized, _ = load(folder)
    layer = quantized.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and isinstance(layer.mlp.up_proj, QuantizedLinear)
    assert isinstance(quantized.model.embed_tokens, QuantizedEmbedding)  # the tied head
    prompt = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play")
    assert len(prompt) >= layer.self_attn.q_proj.dense_from_rows  # the dense route without the kernels
    monkeypatch.setattr(cpu_linear, "QUANTIZED_DENSE_FROM_ROWS", len(prompt))  # and with them
    reference = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=20)]  # nn.QuantizedLinear
    assert [r.token for r in stream_generate(quantized, tokenizer, prompt, max_tokens=20)] == reference


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(128, 96), (64, 200), (64, 600)])  # 600: several decode blocks
def test_cpu_linear_equals_mlx_linear(rows, dtype, shape):
    mx.random.seed(0)
    linear = nn.Linear(*shape, bias=True)
    linear.update({"weight": linear.weight.astype(dtype), "bias": linear.bias.astype(dtype)})
    ours = Linear.from_linear(linear)
    x = mx.random.normal((1, rows, shape[0])).astype(dtype)
    expected = np.array(linear(x).astype(mx.float32))
    assert ours(x).dtype == dtype and ours(x).shape == linear(x).shape
    tolerance = 1e-5 if dtype == mx.float32 else 3e-2
    assert np.allclose(np.array(ours(x).astype(mx.float32)), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_cpu_embedding_head_equals_mlx_as_linear(rows, dtype):
    mx.random.seed(0)
    embedding = nn.Embedding(600, 64)  # 600 rows: several decode blocks, the last one partial
    embedding.update({"weight": embedding.weight.astype(dtype)})
    ours = Embedding.from_embedding(embedding)
    x = mx.random.normal((1, rows, 64)).astype(dtype)
    expected = np.array(embedding.as_linear(x).astype(mx.float32))
    assert ours.as_linear(x).dtype == dtype and ours.as_linear(x).shape == (1, rows, 600)
    tolerance = 1e-5 if dtype == mx.float32 else 3e-2
    assert np.allclose(np.array(ours.as_linear(x).astype(mx.float32)), expected, atol=tolerance, rtol=tolerance)
    ids = mx.array([[3, 599, 0]])
    assert mx.array_equal(ours(ids), embedding(ids))


def test_float16_folder_loads_with_half_linears_and_keeps_the_golden_prefix(stories_hf, tmp_path, golden):
    model, tokenizer = load(stories_hf, dtype=mx.float16)
    assert isinstance(model.layers[0].mlp.down_proj, Linear)
    assert model.layers[0].mlp.down_proj.weight.dtype == mx.float16
    assert isinstance(model.model.embed_tokens, Embedding)  # the tied head decodes in float32 blocks
    prompt = [1, *golden["generated_ids"][:30]]  # long enough for the float32 route
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=20)]
    assert tokens == golden["generated_ids"][30:50]  # margins there are far above float16 error


def test_decoding_splits_quantized_and_half_products_over_the_cpu_streams(monkeypatch):
    """One position through quantized, float16 and wide float32 layers takes the split route;
    a prompt chunk does not (it goes through float32 BLAS blocks). Without mlx_tfm's C++
    kernels: with them, decoding takes those (tests/cpu/test_cpu_kernels.py)."""
    monkeypatch.setattr(cpu_linear, "kernels", lambda: None)
    calls = []
    split = cpu_linear.rows_in_parallel
    monkeypatch.setattr(cpu_linear, "rows_in_parallel", lambda product, out_dims: calls.append(out_dims) or split(product, out_dims))
    mx.random.seed(4)
    quantized = QuantizedLinear.from_linear(nn.Linear(128, 96), group_size=64, bits=4)
    half = Linear.from_linear(nn.Linear(128, 96))
    half.set_dtype(mx.float16)
    head = Embedding.from_embedding(nn.Embedding(2000, 64))  # 2000 > 8 x 64: a wide float32 head
    quantized(mx.random.normal((1, 1, 128)))
    half(mx.random.normal((1, 1, 128)).astype(mx.float16))
    head.as_linear(mx.random.normal((1, 1, 64)))
    assert calls == [96, 96, 2000]
    quantized(mx.random.normal((1, 40, 128)))
    half(mx.random.normal((1, 40, 128)).astype(mx.float16))
    assert calls == [96, 96, 2000]
