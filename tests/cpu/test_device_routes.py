"""The CPU routes (mlx_tfm/cpu/) against the plain MLX routes that Metal and CUDA run.

Tests run on the CPU, so without the switch the generic routes would never run here. Each
test computes the same thing twice on the same weights: with the CPU routes, and inside
``generic_routes()``; and a spy proves which route each run took."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_tfm.model.attention as attention_module
from mlx_tfm.model.cache import window_mask
from mlx_tfm.cpu import generic_routes, on_cpu, specialize
from mlx_tfm.cpu import linear as cpu_linear
from mlx_tfm.cpu.attention import attention_by_query_blocks
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.lora import apply_lora, fuse_adapters

from fixtures.variants import TOKENS, build, decode_in_pieces

SHAPE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)
# 100 positions: dense products (quantized layers the kernels take switch at 96), query blocks
PROMPT = mx.array([[(7 * i + 3) % 300 for i in range(100)]])


def random_model(tied: bool, dtype, bits: int | None) -> Model:
    mx.random.seed(4)
    model = Model(ModelArgs.from_dict({**SHAPE, "tie_word_embeddings": tied}))
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    else:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return specialize(model)


class RouteSpy:
    """Counts the calls into the CPU-only helpers."""

    def __init__(self, monkeypatch):
        self.calls = {"rows_in_parallel": 0, "float32_product": 0, "float32_decode_product": 0,
                      "dense_quantized_product": 0, "dense_half_product": 0, "query_blocks": 0,
                      "kernel_attention": 0}
        for name in ("rows_in_parallel", "float32_product", "float32_decode_product", "dense_quantized_product",
                     "dense_half_product"):
            monkeypatch.setattr(cpu_linear, name, self._counting(name, getattr(cpu_linear, name)))
        monkeypatch.setattr(attention_module, "attention_by_query_blocks",
                            self._counting("query_blocks", attention_module.attention_by_query_blocks))
        monkeypatch.setattr(attention_module, "kernel_attention",
                            self._counting("kernel_attention", attention_module.kernel_attention))

    def _counting(self, name, function):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return function(*args, **kwargs)

        return counted

    def total(self) -> int:
        return sum(self.calls.values())

    def attention(self) -> int:
        """Calls into a CPU attention route: mlx_tfm's kernel, or MLX's op by query blocks
        where the kernels are off."""
        return self.calls["query_blocks"] + self.calls["kernel_attention"]


def prompt_then_decode(model: Model) -> mx.array:
    """Logits of a 100-token prompt (one chunk) and then 3 single tokens through the cache."""
    cache = model.make_cache()
    outputs = [model(PROMPT, cache=cache)]
    for token in (5, 77, 123):
        outputs.append(model(mx.array([[token]]), cache=cache))
    return mx.concatenate(outputs, axis=1).astype(mx.float32)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("weights", ["float32", "float16", "bfloat16", "8-bit", "4-bit"])
def test_generic_routes_equal_the_cpu_routes(weights, tied, monkeypatch):
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(weights, mx.float32)
    bits = {"8-bit": 8, "4-bit": 4}.get(weights)
    model = random_model(tied, dtype, bits)
    spy = RouteSpy(monkeypatch)
    fast = prompt_then_decode(model)
    assert on_cpu() and spy.attention() > 0 and spy.total() > spy.attention()
    before = dict(spy.calls)
    with generic_routes():
        assert not on_cpu()
        generic = prompt_then_decode(model)
    assert spy.calls == before, "the generic run went through a CPU-only route"
    tolerance = {"float32": 1e-4, "float16": 3e-2, "bfloat16": 1.5e-1}.get(weights, 1e-3)
    np.testing.assert_allclose(np.array(fast), np.array(generic), atol=tolerance, rtol=tolerance)
    assert (np.array(fast).argmax(-1) == np.array(generic).argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("L, S", [(11, 11), (5, 16), (1, 9)])
@pytest.mark.parametrize("mask", ["causal", None, "window"])
def test_attention_by_query_blocks_equals_the_fused_op(L, S, mask):
    """Every block of queries sees what the whole chunk's row would: the causal alignment
    at the end of the keys, a row slice of an array mask, all keys without one. GQA: 6
    query heads over 2 KV heads; blocks of 4 do not divide L."""
    mx.random.seed(3)
    queries, keys, values = mx.random.normal((1, 6, L, 8)), mx.random.normal((1, 2, S, 8)), mx.random.normal((1, 2, S, 8))
    if mask == "window":
        mask = window_mask(mx.arange(S - L, S), mx.arange(S), 3)  # (L, S) booleans
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask=mask)
    got = attention_by_query_blocks(queries, keys, values, 0.3, mask, block=4)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["llama-gqa", "gpt2-style-mqa", "gemma2-style"])
def test_query_blocks_in_the_model_equal_the_generic_route(variant, monkeypatch):
    """Chunks of 7 positions with blocks of 2 queries, against the fused op on whole chunks,
    with the plain cache, a rotating one past its bound (array masks) and no cache."""
    model = build(variant)
    monkeypatch.setattr(attention_module, "QUERY_BLOCK", 2)
    pieces = (7, 1, 3)
    fast = [decode_in_pieces(model, TOKENS, model.make_cache(), pieces), model(TOKENS),
            decode_in_pieces(model, TOKENS, model.make_cache(max_kv_size=5), pieces)]
    with generic_routes():
        generic = [decode_in_pieces(model, TOKENS, model.make_cache(), pieces), model(TOKENS),
                   decode_in_pieces(model, TOKENS, model.make_cache(max_kv_size=5), pieces)]
    for got, expected in zip(fast, generic):
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quantized", [False, True])
def test_fused_lora_model_keeps_the_cpu_route(quantized):
    model = random_model(tied=False, dtype=mx.float32, bits=4 if quantized else None)
    model.freeze()
    apply_lora(model, num_layers=2, fine_tune_type="lora", rank=4, scale=10.0, dropout=0.0)
    fuse_adapters(model)
    expected = cpu_linear.QuantizedLinear if quantized else cpu_linear.Linear
    assert isinstance(model.layers[0].self_attn.q_proj, expected)
    assert isinstance(model.lm_head, expected)


def test_specialize_keeps_the_arrays_and_the_frozen_state():
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict({**SHAPE, "tie_word_embeddings": False}))
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: path.endswith("q_proj"))
    model.freeze()
    before = model.layers[0].self_attn.q_proj
    specialize(model)
    after = model.layers[0].self_attn.q_proj
    assert type(after) is cpu_linear.QuantizedLinear and after.weight is before.weight
    assert (after.group_size, after.bits, after.mode) == (before.group_size, before.bits, before.mode)
    assert tree_flatten(model.trainable_parameters()) == []
