"""The Mamba-2 mixer (model/mamba.py) and its SSD scan (model/ssd.py): the chunked form a
prompt takes equals the step form decoding takes, values and gradients; a full forward equals
prefill in pieces plus cached decode; the chunked form is what makes long prompts cheap."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from mlx_tfm.errors import UserError
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.mamba import GatedRMSNorm, Mamba2Mixer, ParallelCache, selective_scan
from mlx_tfm.cpu import generic_routes, on_cpu
from mlx_tfm.model import ssd
from mlx_tfm.model.ssd import ssd_chunked, ssd_step
from mlx_tfm.model.transformer import Model


def scan_inputs(length: int, batch: int = 2, heads: int = 4, head_dim: int = 8, groups: int = 2, state: int = 6,
                seed: int = 0):
    """x (B, L, H, P), dt (B, L, H) > 0, A (H,) < 0, B and C (B, L, G, N)."""
    mx.random.seed(seed)
    x = mx.random.normal((batch, length, heads, head_dim))
    dt = mx.random.uniform(0.05, 0.6, (batch, length, heads))
    A = -mx.random.uniform(0.2, 2.0, (heads,))
    B = mx.random.normal((batch, length, groups, state))
    C = mx.random.normal((batch, length, groups, state))
    return x, dt, A, B, C


def stepped(x, dt, A, B, C, state=None):
    """The recurrence one position at a time: (y (B, L, H, P), final state)."""
    ys = []
    for t in range(x.shape[1]):
        y, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


def naive_recurrence(x, dt, A, B, C) -> np.ndarray:
    """The SSM written out in numpy, one head and one position at a time (an independent
    formula for the scan): state = exp(dt A) state + dt x B^T, y = state C."""
    x, dt, A, B, C = (np.array(t, dtype=np.float64) for t in (x, dt, A, B, C))
    batch, length, heads, head_dim = x.shape
    per_group = heads // B.shape[2]
    y = np.zeros_like(x)
    for b in range(batch):
        for h in range(heads):
            g, state = h // per_group, np.zeros((head_dim, B.shape[3]))
            for t in range(length):
                state = np.exp(dt[b, t, h] * A[h]) * state + dt[b, t, h] * np.outer(x[b, t, h], B[b, t, g])
                y[b, t, h] = state @ C[b, t, g]
    return y


def test_step_form_is_the_recurrence():
    x, dt, A, B, C = scan_inputs(9)
    y, _ = stepped(x, dt, A, B, C)
    np.testing.assert_allclose(np.array(y), naive_recurrence(x, dt, A, B, C), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 32])
def test_chunked_equals_step_over_several_chunks(chunk_size):
    x, dt, A, B, C = scan_inputs(23)
    y_chunked, state_chunked = ssd_chunked(x, dt, A, B, C, chunk_size)
    y_step, state_step = stepped(x, dt, A, B, C)
    np.testing.assert_allclose(np.array(y_chunked), np.array(y_step), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(state_chunked), np.array(state_step), atol=1e-5, rtol=1e-5)


def test_chunked_continues_from_a_state():
    x, dt, A, B, C = scan_inputs(20)
    _, start = stepped(x[:, :6], dt[:, :6], A, B[:, :6], C[:, :6])
    y_chunked, end_chunked = ssd_chunked(x[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], 4, start)
    y_step, end_step = stepped(x[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], start)
    np.testing.assert_allclose(np.array(y_chunked), np.array(y_step), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(end_chunked), np.array(end_step), atol=1e-5, rtol=1e-5)


def test_gradients_equal_through_both_forms():
    inputs = scan_inputs(13, batch=1)
    weights = mx.random.normal((1, 13, 4, 8))

    def loss(form):
        return lambda *args: (form(*args)[0] * weights).sum()

    chunked = mx.grad(loss(lambda *a: ssd_chunked(*a, 4)), argnums=(0, 1, 2, 3, 4))(*inputs)
    step = mx.grad(loss(stepped), argnums=(0, 1, 2, 3, 4))(*inputs)
    for name, g_chunked, g_step in zip("x dt A B C".split(), chunked, step):
        assert np.all(np.isfinite(np.array(g_chunked))), name
        np.testing.assert_allclose(np.array(g_chunked), np.array(g_step), atol=1e-4, rtol=1e-4, err_msg=name)



def test_the_cpu_route_reads_long_chunks_in_shorter_ones(monkeypatch):
    """A checkpoint's chunks of 256 (Mamba-2's) run as chunks of ``CPU_CHUNK`` on the CPU
    route and whole on the plain route (what Metal runs); both are the stepped scan."""
    lengths = []
    real_chunk_scan = ssd.chunk_scan
    monkeypatch.setattr(ssd, "chunk_scan", lambda x, *rest: lengths.append(x.shape[1]) or real_chunk_scan(x, *rest))
    x, dt, A, B, C = scan_inputs(300, batch=1)
    y_step, state_step = stepped(x, dt, A, B, C)
    y_cpu, state_cpu = ssd_chunked(x, dt, A, B, C, 256)
    assert lengths == ([64, 64, 64, 64, 44] if on_cpu() else [256, 44])
    lengths.clear()
    with generic_routes():
        y_plain, state_plain = ssd_chunked(x, dt, A, B, C, 256)
    assert lengths == [256, 44]
    for y, state in ((y_cpu, state_cpu), (y_plain, state_plain)):
        np.testing.assert_allclose(np.array(y), np.array(y_step), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.array(state), np.array(state_step), atol=1e-4, rtol=1e-4)

# -- the mixer and models built of it ------------------------------------------------------

MAMBA = dict(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, mamba_num_heads=4,
             mamba_head_dim=16, mamba_state_size=8, mamba_n_groups=2, mamba_chunk_size=5)


def randomized(model, seed: int = 0):
    """Every parameter drawn at O(0.3) scale (the init leaves the conv at zero)."""
    mx.random.seed(seed)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.3, model.parameters()))
    return model


def decoded(model, ids: mx.array, pieces: list[int]) -> mx.array:
    """Logits of ``ids`` read as prompt pieces of these lengths, then one token at a time."""
    cache, outputs, start = model.make_cache(), [], 0
    for length in pieces:
        outputs.append(model(ids[:, start : start + length], cache=cache))
        start += length
    for t in range(start, ids.shape[1]):
        outputs.append(model(ids[:, t : t + 1], cache=cache))
    assert all(c.offset == ids.shape[1] for c in cache)
    return mx.concatenate(outputs, axis=1)


@pytest.mark.parametrize("layers", [
    dict(layer_types=["mamba"] * 3, block_sublayers=["mixer"] * 3),  # pure Mamba-2
    dict(layer_types=["mamba", "full_attention", "mamba"]),  # a hybrid, every block with its MLP
    dict(layer_types=["mamba", "full_attention", "mamba"], block_sublayers=["mixer", "mixer", "mlp"]),  # Nemotron-H
], ids=["mamba2", "hybrid", "one_sublayer"])
def test_full_forward_equals_prefill_in_pieces_and_decode(layers):
    model = randomized(Model(ModelArgs.from_dict({**MAMBA, **layers})))
    ids = mx.random.randint(0, 256, (2, 24))
    full = model(ids)
    np.testing.assert_allclose(np.array(decoded(model, ids, [7, 6])), np.array(full), atol=1e-5, rtol=1e-5)


def test_cache_holds_conv_and_ssm_state():
    args = ModelArgs.from_dict({**MAMBA, "layer_types": ["mamba"] * 3, "block_sublayers": ["mixer"] * 3})
    model = randomized(Model(args))
    cache = model.make_cache()
    model(mx.zeros((2, 9), mx.int32), cache=cache)
    conv_state, ssm_state = cache[0].arrays
    assert conv_state.shape == (2, 3, 64 + 2 * 2 * 8)  # (B, K - 1, conv_dim)
    assert ssm_state.shape == (2, 4, 16, 8)  # (B, H, P, N)
    assert not cache[0].is_trimmable()


def fastest(run, repeats: int = 3) -> float:
    """Seconds of the fastest of ``repeats`` runs (the CPU is shared: the minimum is the
    least disturbed)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def test_chunked_prompt_is_at_least_10x_faster_than_stepping():
    """A 2,000-token prompt through one mixer in one call (chunks of 256) against the step
    form, each position evaluated as decoding does. A step costs the same at every position
    (the state has a fixed size), so 200 steps, times 10, stand for all 2,000."""
    args = ModelArgs.from_dict({**MAMBA, "layer_types": ["mamba"] * 3, "mamba_state_size": 16, "mamba_n_groups": 1,
                                "mamba_chunk_size": 256})
    mixer = randomized(Mamba2Mixer(args, 0))
    x = mx.random.normal((1, 2000, 32))
    mx.eval(x)

    def prompt():
        cache = mixer.make_cache()
        mx.eval(mixer(x, cache=cache), cache.arrays)

    def steps():
        cache = mixer.make_cache()
        for t in range(200):
            mx.eval(mixer(x[:, t : t + 1], cache=cache), cache.arrays)

    prompt()  # compiles the decay kernel for these shapes
    chunked_s, stepped_s = fastest(prompt, 5), 10 * fastest(steps)
    assert chunked_s * 10 < stepped_s, (chunked_s, stepped_s)


def test_time_steps_are_clipped_to_the_configured_limits():
    args = ModelArgs.from_dict({**MAMBA, "layer_types": ["mamba"] * 3, "mamba_time_step_limit": [0.4, 0.9]})
    mixer = randomized(Mamba2Mixer(args, 0))
    raw = mx.random.normal((1, 50, 4)) * 3
    expected = np.clip(np.log1p(np.exp(np.array(raw) + np.array(mixer.dt_bias))), 0.4, 0.9)
    np.testing.assert_allclose(np.array(mixer._time_steps(raw)), expected, atol=1e-6)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_norm_normalises_each_group(norm_before_gate):
    norm = GatedRMSNorm(8, 2, 1e-6, norm_before_gate)
    norm.weight = mx.arange(1, 9, dtype=mx.float32)
    y, z = mx.random.normal((3, 8)), mx.random.normal((3, 8))
    gate = np.array(z) / (1 + np.exp(-np.array(z)))
    y_np = np.array(y) if norm_before_gate else np.array(y) * gate
    groups = y_np.reshape(3, 2, 4)
    normed = (groups / np.sqrt((groups**2).mean(-1, keepdims=True) + 1e-6)).reshape(3, 8)
    expected = np.arange(1, 9) * (normed * gate if norm_before_gate else normed)
    np.testing.assert_allclose(np.array(norm(y, z)), expected, atol=1e-5, rtol=1e-5)


def test_mamba_beside_attention_keeps_a_parallel_cache():
    """Falcon-H1's layers: the attention's KV cache and the mixer's state advance together;
    a copy is independent, and like any state the pair cannot be trimmed."""
    args = ModelArgs.from_dict({**MAMBA, "mamba_beside_attention": True})
    model = randomized(Model(args))
    ids = mx.random.randint(0, 256, (1, 16))
    np.testing.assert_allclose(np.array(decoded(model, ids, [5])), np.array(model(ids)), atol=1e-5, rtol=1e-5)
    cache = model.make_cache()
    assert all(isinstance(c, ParallelCache) for c in cache)
    model(ids[:, :6], cache=cache)
    snapshot = [c.copy() for c in cache]
    after = model(ids[:, 6:7], cache=cache)
    np.testing.assert_allclose(np.array(model(ids[:, 6:7], cache=snapshot)), np.array(after), atol=1e-6)
    assert (cache[0].offset, snapshot[0].offset, cache[0].mamba.offset) == (7, 7, 7)
    assert not cache[0].is_trimmable() and cache[0].trim(0) == 0
    with pytest.raises(UserError, match="cannot be trimmed"):
        cache[0].trim(1)
    with pytest.raises(ValueError, match="a Mamba-2 mixer beside attention needs pre-norm attention layers"):
        Model(ModelArgs.from_dict({**MAMBA, "mamba_beside_attention": True, "layer_types": ["mamba"] * 3}))


def test_block_sublayers_are_checked():
    with pytest.raises(ValueError, match="unknown block_sublayers entry 'attention'"):
        ModelArgs.from_dict({**MAMBA, "block_sublayers": ["mixer", "attention", "mlp"]})
    with pytest.raises(ValueError, match="block_sublayers has 2 entries for 3 layers"):
        ModelArgs.from_dict({**MAMBA, "block_sublayers": ["mixer", "mlp"]})


# -- Mamba-1's selective scan (layer type "mamba1") ------------------------------------------


def selective_inputs(length: int, batch: int = 2, inner: int = 6, state: int = 5, seed: int = 1):
    """x and dt (B, L, I), A (I, N) < 0, B and C (B, L, N)."""
    mx.random.seed(seed)
    return (mx.random.normal((batch, length, inner)), mx.random.uniform(0.05, 0.8, (batch, length, inner)),
            -mx.random.uniform(0.2, 3.0, (inner, state)), mx.random.normal((batch, length, state)),
            mx.random.normal((batch, length, state)))


def naive_selective_scan(x, dt, A, B, C) -> np.ndarray:
    """state = exp(dt A) * state + dt x B (per channel and state), y = state C, in numpy."""
    x, dt, A, B, C = (np.array(t, dtype=np.float64) for t in (x, dt, A, B, C))
    state, ys = np.zeros((x.shape[0], *A.shape)), []
    for t in range(x.shape[1]):
        state = np.exp(dt[:, t, :, None] * A) * state + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append(state @ C[:, t, :, None])
    return np.concatenate(ys, axis=-1).transpose(0, 2, 1)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_selective_scan_chunks_equal_the_recurrence(chunk_size):
    inputs = selective_inputs(19)
    y, _ = selective_scan(*inputs, chunk_size, None)
    np.testing.assert_allclose(np.array(y), naive_selective_scan(*inputs), atol=1e-5, rtol=1e-5)


def test_selective_scan_continues_from_its_state_and_gradients_agree():
    x, dt, A, B, C = selective_inputs(12, batch=1)
    y_full, state_full = selective_scan(x, dt, A, B, C, 5, None)
    y_head, state = selective_scan(x[:, :7], dt[:, :7], A, B[:, :7], C[:, :7], 4, None)
    steps = [y_head]
    for t in range(7, 12):
        y, state = selective_scan(x[:, t : t + 1], dt[:, t : t + 1], A, B[:, t : t + 1], C[:, t : t + 1], 4, state)
        steps.append(y)
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)), np.array(y_full), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(state), np.array(state_full), atol=1e-5, rtol=1e-5)
    weights = mx.random.normal(y_full.shape)
    chunked = mx.grad(lambda *a: (selective_scan(*a, 4, None)[0] * weights).sum(), argnums=(0, 1, 2, 3, 4))
    stepped = mx.grad(lambda *a: (selective_scan(*a, 1, None)[0] * weights).sum(), argnums=(0, 1, 2, 3, 4))
    for name, g_chunked, g_step in zip("x dt A B C".split(), chunked(x, dt, A, B, C), stepped(x, dt, A, B, C)):
        np.testing.assert_allclose(np.array(g_chunked), np.array(g_step), atol=1e-4, rtol=1e-4, err_msg=name)


def test_mamba1_model_decodes_as_its_full_forward():
    args = ModelArgs.from_dict({**MAMBA, "layer_types": ["mamba1"] * 3, "block_sublayers": ["mixer"] * 3,
                                "mamba_inner_size": 64, "mamba_dt_rank": 4})
    model = randomized(Model(args))
    ids = mx.random.randint(0, 256, (2, 20))
    np.testing.assert_allclose(np.array(decoded(model, ids, [6, 5])), np.array(model(ids)), atol=1e-5, rtol=1e-5)
