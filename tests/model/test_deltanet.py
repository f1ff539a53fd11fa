"""Gated DeltaNet (mlx_tfm/model/deltanet.py): the step form against the recurrence written
out in numpy, the chunked form against the step form (outputs, states and gradients), the
layer's cache (full forward == prefill in pieces + decode) and its bad configurations."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tfm.errors import UserError
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.deltanet import (
    GatedDeltaNet,
    delta_rule_chunked,
    delta_rule_steps,
    l2_normalised,
    unit_lower_inverse,
)
from mlx_tfm.model.state_cache import StateCache
from mlx_tfm.model.transformer import Model

HYBRID = dict(model_type="qwen3_next", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, vocab_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_chunk_size=16, attn_output_gate=True, qk_norm=True,
              partial_rotary_factor=0.5, tie_word_embeddings=False,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def recurrence_inputs(length: int, strong_decay: bool = False, seed: int = 0, B: int = 2, H: int = 3):
    """queries, keys (B, H, L, 8), values (B, H, L, 4), g, beta (B, H, L), state (B, H, 8, 4).
    ``strong_decay``: every 8th position forgets almost everything (g = -150), so the decay
    summed over a chunk reaches a thousand while nearby positions still see each other."""
    rng = np.random.default_rng(seed)
    Dk, Dv = 8, 4
    queries = l2_normalised(mx.array(rng.normal(size=(B, H, length, Dk)), mx.float32)) * Dk ** -0.5
    keys = l2_normalised(mx.array(rng.normal(size=(B, H, length, Dk)), mx.float32))
    values = mx.array(rng.normal(size=(B, H, length, Dv)), mx.float32)
    g = -rng.uniform(0, 0.1 if strong_decay else 1.0, size=(B, H, length))
    if strong_decay:
        g[..., ::8] = -150.0
    g = mx.array(g, mx.float32)
    beta = mx.array(rng.uniform(0, 1, size=(B, H, length)), mx.float32)
    state = mx.array(rng.normal(size=(B, H, Dk, Dv)) * 0.3, mx.float32)
    return queries, keys, values, g, beta, state


def numpy_recurrence(queries, keys, values, g, beta, state):
    """The gated delta rule as its definition reads, in float64, one head at a time."""
    q, k, v, g, beta, S = (np.array(t, dtype=np.float64) for t in (queries, keys, values, g, beta, state))
    B, H, L, _ = q.shape
    out = np.zeros((*q.shape[:3], v.shape[-1]))
    for b in range(B):
        for h in range(H):
            s = S[b, h].copy()
            for t in range(L):
                s = np.exp(g[b, h, t]) * s
                s = s + np.outer(k[b, h, t], beta[b, h, t] * (v[b, h, t] - k[b, h, t] @ s))
                out[b, h, t] = q[b, h, t] @ s
            S[b, h] = s
    return out, S


def test_step_form_is_the_gated_delta_rule():
    inputs = recurrence_inputs(20)
    out, state = delta_rule_steps(*inputs)
    expected_out, expected_state = numpy_recurrence(*inputs)
    np.testing.assert_allclose(np.array(out), expected_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(state), expected_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strong_decay", [False, True], ids=["mild", "strong"])
def test_chunked_equals_steps_over_several_chunks(strong_decay):
    """200 positions in chunks of 64 (the last one padded), from a non-zero state: with
    strong decay the summed decay within a chunk reaches a thousand, where a plain running
    sum would lose the small decays between nearby positions (to about 3e-5)."""
    inputs = recurrence_inputs(200, strong_decay)
    out_steps, state_steps = delta_rule_steps(*inputs)
    out_chunks, state_chunks = delta_rule_chunked(*inputs, chunk_size=64)
    np.testing.assert_allclose(np.array(out_chunks), np.array(out_steps), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(state_chunks), np.array(state_steps), atol=1e-5, rtol=0)
    expected_out, _ = numpy_recurrence(*inputs)
    np.testing.assert_allclose(np.array(out_chunks), expected_out, atol=1e-5, rtol=0)


def test_gradients_through_both_forms_agree():
    queries, keys, values, g, beta, state = recurrence_inputs(40, seed=1, B=1, H=2)
    target = mx.array(np.random.default_rng(2).normal(size=(1, 2, 40, 4)), mx.float32)

    def loss(form, q, k, v, g, beta, s):
        out, final = form(q, k, v, g, beta, s)
        return mx.mean((out - target) ** 2) + mx.mean(final ** 2)

    arguments = (queries, keys, values, g, beta, state)
    by_steps = mx.grad(lambda *a: loss(delta_rule_steps, *a), argnums=tuple(range(6)))(*arguments)
    by_chunks = mx.grad(lambda *a: loss(lambda *b: delta_rule_chunked(*b, chunk_size=16), *a),
                        argnums=tuple(range(6)))(*arguments)
    for name, steps, chunks in zip(("queries", "keys", "values", "g", "beta", "state"), by_steps, by_chunks):
        assert np.abs(np.array(steps)).max() > 0, name
        np.testing.assert_allclose(np.array(chunks), np.array(steps), atol=1e-5, rtol=0, err_msg=name)


def test_unit_lower_inverse_is_the_inverse():
    rng = np.random.default_rng(3)
    m = rng.normal(size=(3, 64, 64)).astype(np.float32) * 0.3
    inverse = np.array(unit_lower_inverse(mx.array(m)))
    expected = np.linalg.inv(np.tril(m.astype(np.float64), -1) + np.eye(64))
    np.testing.assert_allclose(inverse, expected, atol=1e-4, rtol=1e-4)


def hybrid_model(seed: int = 0, **overrides) -> Model:
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict({**HYBRID, **overrides}))
    model.set_dtype(mx.float32)
    return model


def test_make_cache_gives_linear_layers_a_state_cache():
    model = hybrid_model()
    caches = model.make_cache()
    assert [isinstance(c, StateCache) for c in caches] == [True, True, False, True]
    model(mx.array([[3, 4, 5]]), cache=caches)
    conv_state, recurrent_state = caches[0].arrays
    assert conv_state.shape == (1, 3, 2 * 2 * 8 + 4 * 8)  # (B, kernel - 1, conv_dim)
    assert recurrent_state.shape == (1, 4, 8, 8)  # (B, Hv, Dk, Dv)
    assert caches[0].offset == 3 and caches[2].offset == 3


def test_full_forward_equals_prefill_in_pieces_and_decode():
    """70 positions: a 37-position prefill (chunked: two chunks of 16 and a padded one), a
    piece of 5 (steps), a piece of 20 (chunked, from the cached state), then 8 decoded one
    at a time, against one forward pass over all 70."""
    model = hybrid_model()
    tokens = mx.array(np.random.default_rng(4).integers(0, 256, size=(2, 70)))
    full = model(tokens)
    cache = model.make_cache()
    pieces = [model(tokens[:, :37], cache=cache), model(tokens[:, 37:42], cache=cache),
              model(tokens[:, 42:62], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(62, 70)]
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(full), atol=1e-4, rtol=0)
    assert cache[0].offset == 70


def test_layer_reads_prompts_chunked_and_decodes_by_steps():
    """The module's two routes give the same output: a 100-position input read at once
    (chunked) and read one position at a time through the cache."""
    args = ModelArgs.from_dict(HYBRID)
    mx.random.seed(5)
    layer = GatedDeltaNet(args, 0)
    x = mx.random.normal((1, 100, 32))
    whole = layer(x)
    cache = layer.make_cache()
    stepped = mx.concatenate([layer(x[:, t : t + 1], None, cache) for t in range(100)], axis=1)
    np.testing.assert_allclose(np.array(stepped), np.array(whole), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(linear_num_key_heads=0), "linear_attention layers need"),
    (dict(linear_num_key_heads=3), r"linear_num_value_heads \(4\) is not a multiple of linear_num_key_heads \(3\)"),
    (dict(linear_chunk_size=48), "linear_chunk_size must be a power of two, not 48"),
    (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim must be at least 2, not 1"),
])
def test_bad_linear_attention_settings_are_named(fields, message):
    with pytest.raises(UserError, match=message):
        Model(ModelArgs.from_dict({**HYBRID, **fields}))
