"""The compiled decoding step (model/compiled.py): each block's cache-free pieces through
mx.compile give the plain call's logits and tokens, on the CPU routes and on the plain MLX
routes, in float32 and 4-bit; models it does not cover decode as before."""

import contextlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tfm.cpu import generic_routes, specialize
from mlx_tfm.generation.step import generate_step
from mlx_tfm.model import compiled
from mlx_tfm.model.cache import KVQuantization, QuantizedKVCache
from mlx_tfm.model.compiled import CompiledDecoder, decoder_for
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.transformer import Model

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, rope_theta=10000.0)
PROMPT = mx.array([[3, 17, 42, 7, 99, 5]])


def tiny_model(form: str = "float32", **overrides) -> Model:
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict({**TINY, **overrides}))
    if form == "4bit":
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return specialize(model)


def greedy_decode(forward, model, steps: int = 32, cache=None) -> tuple[list[int], list[np.ndarray]]:
    """Prefill PROMPT through the plain call, then ``steps`` greedy steps through
    ``forward(token (1, 1), cache)``: the tokens fed to the steps, and each step's logits (V,)."""
    cache = cache if cache is not None else model.make_cache()
    token = mx.argmax(model(PROMPT, cache=cache)[:, -1], axis=-1, keepdims=True)  # (1, 1)
    fed, logits = [], []
    for _ in range(steps):
        fed.append(token.item())
        step_logits = forward(token, cache)[0, -1]  # (V,)
        token = mx.argmax(step_logits)[None, None]
        logits.append(np.array(step_logits))
    return fed, logits


def plain(model):
    return lambda token, cache: model(token, cache=cache)


@pytest.mark.parametrize("form", ["float32", "4bit"])
@pytest.mark.parametrize("routes", ["cpu", "generic"])
def test_compiled_steps_give_the_plain_calls_tokens_and_logits(form, routes):
    model = tiny_model(form)
    assert CompiledDecoder.takes(model)
    with generic_routes() if routes == "generic" else contextlib.nullcontext():
        want_tokens, want_logits = greedy_decode(plain(model), model)
        got_tokens, got_logits = greedy_decode(CompiledDecoder(model), model)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["float32", "4bit"])
def test_compiled_steps_equal_the_full_forward(form):
    """Full forward over prompt + generated tokens == the compiled cached steps' logits."""
    model = tiny_model(form)
    fed, logits = greedy_decode(CompiledDecoder(model), model, steps=12)
    full = model(mx.concatenate([PROMPT, mx.array([fed])], axis=1))  # (1, prompt + steps, V)
    np.testing.assert_allclose(np.stack(logits), np.array(full[0, PROMPT.shape[1]:]), atol=1e-4, rtol=1e-4)


def test_a_rotating_cache_past_its_window_decodes_the_same():
    model = tiny_model()
    want, _ = greedy_decode(plain(model), model, cache=model.make_cache(max_kv_size=8))  # 6 + 32 positions pass 8
    got, _ = greedy_decode(CompiledDecoder(model), model, cache=model.make_cache(max_kv_size=8))
    assert got == want


def test_weights_changed_after_the_trace_are_used():
    """The pieces read the block's arrays at every call (implicit inputs), never the
    values they were traced with."""
    model = tiny_model()
    decoder = CompiledDecoder(model)
    greedy_decode(decoder, model, steps=2)  # traced
    down = model.layers[1].mlp.down_proj
    down.weight = down.weight * 3.0
    want_tokens, want_logits = greedy_decode(plain(model), model, steps=4)
    got_tokens, got_logits = greedy_decode(decoder, model, steps=4)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [dict(norm_placement="parallel"), dict(attn_output_gate=True),
                                       dict(position_embedding="learned"), dict(norm_placement="sandwich")])
def test_models_it_does_not_cover_decode_through_their_own_call(overrides):
    model = tiny_model(**overrides)
    assert not CompiledDecoder.takes(model)
    assert decoder_for(model) is None
    tokens = [token for token, _ in generate_step(PROMPT[0], model, max_tokens=4)]
    assert len(tokens) == 4


def test_one_decoder_per_model_until_its_modules_change(monkeypatch):
    model = tiny_model()
    first = decoder_for(model)
    assert first is not None and decoder_for(model) is first
    model.layers[0].mlp.up_proj = nn.Linear(64, 128, bias=False)  # a swapped module: traces go stale
    assert decoder_for(model) is not first
    monkeypatch.setattr(compiled, "_enabled", False)
    assert decoder_for(model) is None


def test_generate_step_decodes_through_the_compiled_pieces(monkeypatch):
    """generate_step's decoding steps go through the decoder (its first step, the prompt's
    last token, too), and yield what the plain calls give."""
    model = tiny_model("4bit")
    monkeypatch.setattr(compiled, "_enabled", False)
    want = [token for token, _ in generate_step(PROMPT[0], model, max_tokens=16)]
    monkeypatch.setattr(compiled, "_enabled", True)
    calls = []
    original = CompiledDecoder.__call__
    monkeypatch.setattr(CompiledDecoder, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    got = [token for token, _ in generate_step(PROMPT[0], model, max_tokens=16)]
    assert got == want
    assert len(calls) == 17  # the prompt's last token and every yielded one (the last queued too)


def test_a_quantized_kv_cache_decodes_the_same():
    """Quantized keys and values (past ``start``) meet attention outside the compiled pieces."""
    model = tiny_model(hidden_size=128)  # head_dim 32: a KV group size fits

    def quantized_cache():
        return [QuantizedKVCache(KVQuantization(bits=8, start=8)) for _ in model.layers]

    want, want_logits = greedy_decode(plain(model), model, steps=12, cache=quantized_cache())
    got, got_logits = greedy_decode(CompiledDecoder(model), model, steps=12, cache=quantized_cache())
    assert got == want
    np.testing.assert_allclose(np.stack(got_logits), np.stack(want_logits), atol=1e-5, rtol=1e-5)
