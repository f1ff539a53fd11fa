"""LFM2's gated short convolution: its math against an independent loop, and the
invariant that a full forward equals prefilling in pieces and decoding one at a time."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.recurrent_models import LFM2_LIKE, tiny_lfm2

from mlx_tfm.errors import UserError
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.short_conv import ShortConv
from mlx_tfm.model.state_cache import StateCache


def reference_short_conv(conv: ShortConv, x: np.ndarray) -> np.ndarray:
    """out_proj(C * sum_k w[:, k] * (B * x)[t - (K - 1) + k]), zeros before position 0."""
    w_in = np.array(conv.in_proj.weight)
    bcx = x @ w_in.T + (np.array(conv.in_proj.bias) if "bias" in conv.in_proj else 0)
    D = x.shape[-1]
    b, c, v = bcx[..., :D], bcx[..., D:2 * D], bcx[..., 2 * D:]
    gated = b * v  # (B, L, D)
    taps = np.array(conv.conv.weight)[:, :, 0]  # (D, K)
    K = taps.shape[1]
    out = np.zeros_like(gated)
    for t in range(x.shape[1]):
        for k in range(K):
            source = t - (K - 1) + k
            if source >= 0:
                out[:, t] += taps[:, k] * gated[:, source]
    if "bias" in conv.conv:
        out = out + np.array(conv.conv.bias)
    y = (c * out) @ np.array(conv.out_proj.weight).T
    return y + (np.array(conv.out_proj.bias) if "bias" in conv.out_proj else 0)


@pytest.mark.parametrize("kernel,bias", [(3, False), (4, True), (1, False)])
def test_short_conv_matches_the_formula(kernel, bias):
    mx.random.seed(1)
    args = ModelArgs.from_dict({**LFM2_LIKE, "conv_L_cache": kernel, "conv_bias": bias})
    conv = ShortConv(args, 0)
    x = mx.random.normal((2, 7, args.hidden_size))
    np.testing.assert_allclose(np.array(conv(x)), reference_short_conv(conv, np.array(x)), atol=1e-5)


def test_the_state_holds_the_last_inputs_and_counts_positions():
    args = ModelArgs.from_dict(LFM2_LIKE)
    conv = ShortConv(args, 0)
    cache = conv.make_cache()
    assert isinstance(cache, StateCache) and len(cache.arrays) == 1
    conv(mx.random.normal((1, 5, args.hidden_size)), None, cache)
    assert cache.offset == 5 and cache[0].shape == (1, args.conv_L_cache - 1, args.hidden_size)


@pytest.mark.parametrize("pieces", [[14], [1] * 14, [5, 1, 1, 7], [2, 9, 3]])
def test_full_forward_equals_pieces_and_cached_decode(pieces):
    model = tiny_lfm2()
    tokens = mx.array([[5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]])
    full = model(tokens)
    cache = model.make_cache()
    assert [type(c).__name__ for c in cache] == ["StateCache", "KVCache", "StateCache"]
    outputs, start = [], 0
    for length in pieces:
        outputs.append(model(tokens[:, start:start + length], cache=cache))
        start += length
    np.testing.assert_allclose(np.array(mx.concatenate(outputs, axis=1)), np.array(full), atol=1e-4)


def test_a_batch_of_rows_equals_each_row_alone():
    model = tiny_lfm2()
    tokens = mx.array([[5, 17, 200, 33, 9], [8, 1, 2, 250, 7]])
    cache = model.make_cache()
    together = model(tokens, cache=cache)
    np.testing.assert_allclose(np.array(together[1:]), np.array(model(tokens[1:])), atol=1e-4)


def test_a_state_cannot_be_trimmed():
    cache = StateCache(1)
    assert not cache.is_trimmable() and cache.trim(0) == 0
    with pytest.raises(UserError, match="cannot be trimmed"):
        cache.trim(2)


def test_a_copy_is_not_changed_by_an_update_in_place():
    cache = StateCache(1)
    cache[0] = mx.zeros((1, 2, 4))
    snapshot = cache.copy()
    cache[0][..., 0] = 5.0  # a mixer that writes its state in place
    assert snapshot[0].sum().item() == 0 and snapshot.offset == cache.offset
