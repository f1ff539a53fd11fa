"""Lightning attention (mlx_tfm/model/lightning.py): the step form against the recurrence
written out in numpy, the chunked form against the step form, the slopes against their
formula, and a MiniMax model's cache (full forward == prefill in pieces + decode)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.model.lightning import LightningAttention, lightning_chunked, lightning_slopes, lightning_steps
from mlx_tfm.model.state_cache import StateCache
from mlx_tfm.model.transformer import Model

# transformers' config keys: lightning, attention, lightning, lightning; residual weights off 1
MINIMAX = dict(model_type="minimax", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
               linear_attn_alpha_factor=1.2, linear_attn_beta_factor=0.8, mlp_alpha_factor=0.7, mlp_beta_factor=1.3)


def recurrence_inputs(length: int, seed: int = 0, B: int = 2, H: int = 3):
    rng = np.random.default_rng(seed)
    queries, keys = (mx.array(rng.normal(size=(B, H, length, 8)) * 0.3, mx.float32) for _ in range(2))
    values = mx.array(rng.normal(size=(B, H, length, 4)), mx.float32)
    g = mx.array(-rng.uniform(0, 1.0, size=(B, H, length)), mx.float32)
    state = mx.array(rng.normal(size=(B, H, 8, 4)) * 0.3, mx.float32)
    return queries, keys, values, g, state


def numpy_recurrence(queries, keys, values, g, state):
    """S = exp(g) S + k v^T, o = q^T S, in float64."""
    q, k, v, g, S = (np.array(t, dtype=np.float64) for t in (queries, keys, values, g, state))
    out = np.zeros((*q.shape[:3], v.shape[-1]))
    for t in range(q.shape[2]):
        S = np.exp(g[:, :, t])[..., None, None] * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        out[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], S)
    return out, S


def test_step_form_is_the_recurrence():
    inputs = recurrence_inputs(20)
    out, state = lightning_steps(*inputs)
    expected_out, expected_state = numpy_recurrence(*inputs)
    np.testing.assert_allclose(np.array(out), expected_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(state), expected_state, atol=1e-5, rtol=0)


def test_chunked_equals_steps_over_several_chunks():
    """100 positions in chunks of 16, the last one padded (its padding must not decay the state)."""
    inputs = recurrence_inputs(100)
    out_steps, state_steps = lightning_steps(*inputs)
    out_chunks, state_chunks = lightning_chunked(*inputs, chunk_size=16)
    np.testing.assert_allclose(np.array(out_chunks), np.array(out_steps), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(state_chunks), np.array(state_steps), atol=1e-5, rtol=0)


def test_slopes_are_alibi_rates_shrunk_with_depth():
    expected = [(2 ** (-8 / 4)) ** (h + 1) * (1 - 2 / (5 - 1 + 1e-5) + 1e-5) for h in range(4)]
    np.testing.assert_allclose(np.array(lightning_slopes(4, 2, 5)), expected, rtol=1e-6)


def minimax_model(seed: int = 0, **overrides) -> Model:
    mx.random.seed(seed)
    model = Model(model_args_from_config({**MINIMAX, **overrides}))
    model.set_dtype(mx.float32)
    return model


def test_config_builds_lightning_layers_and_weighted_residuals():
    args = model_args_from_config(MINIMAX)
    assert args.layer_types[:2] == ("lightning_attention", "full_attention")
    assert args.norm_placement == "normed_residual"
    block = minimax_model().model.layers[0]
    assert (block.mixer_alpha, block.mixer_beta, block.mlp_alpha, block.mlp_beta) == (1.2, 0.8, 0.7, 1.3)
    assert [isinstance(c, StateCache) for c in minimax_model().make_cache()] == [True, False, True, True]


def test_full_forward_equals_prefill_in_pieces_and_decode():
    model = minimax_model(linear_chunk_size=16)
    tokens = mx.array(np.random.default_rng(4).integers(0, 256, size=(2, 60)))
    full = model(tokens)
    cache = model.make_cache()
    pieces = [model(tokens[:, :37], cache=cache), model(tokens[:, 37:42], cache=cache),
              model(tokens[:, 42:52], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(52, 60)]
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(full), atol=1e-4, rtol=0)
    assert cache[0].offset == 60 and cache[1].offset == 60


def test_layer_reads_prompts_chunked_and_decodes_by_steps():
    args = model_args_from_config({**MINIMAX, "linear_chunk_size": 16})
    mx.random.seed(5)
    layer = LightningAttention(args, 0)
    x = mx.random.normal((1, 50, 32))
    whole = layer(x)
    cache = layer.make_cache()
    stepped = mx.concatenate([layer(x[:, t : t + 1], None, cache) for t in range(50)], axis=1)
    np.testing.assert_allclose(np.array(stepped), np.array(whole), atol=1e-5, rtol=0)


def test_unknown_minimax_layer_type_is_named():
    with pytest.raises(UserError, match="minimax layer type 'mamba' is not supported"):
        model_args_from_config({**MINIMAX, "layer_types": ["mamba"] * 4})
