"""The chunked gated delta rule's CPU kernel (cpu/deltanet.py) against the plain MLX route
Metal and CUDA run (model/deltanet.py's ``plain_delta_rule_chunked``) and the step form:
outputs, final state and gradients, ragged last chunks, a starting state, 16-bit inputs,
decays strong enough to underflow a chunk's product, and each instruction set."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_tfm.cpu import deltanet as cpu_deltanet

try:  # the extension itself, so that these tests run with MLX_TFM_KERNELS=0 too
    from mlx_tfm.cpu.kernels import _kernels as K
except ImportError as error:  # not built: fail loudly, never skip
    raise AssertionError(f"mlx_tfm's CPU kernels are not built: {error}") from error
from mlx_tfm.model.deltanet import delta_rule_chunked, delta_rule_steps, l2_normalised, plain_delta_rule_chunked


def heads(B, H, L, Dk, Dv, decay=1.0, seed=0):
    """Inputs as Gated DeltaNet makes them: unit keys, queries scaled by 1/sqrt(Dk), decays
    log-uniform below 0 (times ``decay``), beta in (0, 1), a non-zero starting state."""
    mx.random.seed(seed)
    queries = l2_normalised(mx.random.normal((B, H, L, Dk))) * Dk ** -0.5
    keys = l2_normalised(mx.random.normal((B, H, L, Dk)))
    values = mx.random.normal((B, H, L, Dv))
    g = -mx.random.uniform(0, 1, (B, H, L)) * decay
    beta = mx.random.uniform(0, 1, (B, H, L))
    state = mx.random.normal((B, H, Dk, Dv)) * 0.1
    return [queries, keys, values, g, beta, state]


def test_the_kernel_runs_unless_switched_off():
    """Fails loudly where the kernels are not built (the comparisons below would be of the
    plain route with itself); with MLX_TFM_KERNELS=0 (CI's second pass) the plain route runs."""
    on = os.environ.get("MLX_TFM_KERNELS", "1") != "0"
    assert cpu_deltanet.takes(mx.zeros((1, 1, 4))) == on
    assert not cpu_deltanet.takes(mx.zeros((1, 1, 4, 8)))  # Kimi's per-channel decay: the plain route


@pytest.mark.parametrize("shape, chunk", [((2, 3, 37, 8, 4), 16), ((1, 2, 200, 16, 24), 64),
                                          ((1, 2, 130, 128, 128), 32), ((1, 1, 9, 4, 4), 1)])
def test_kernel_equals_the_plain_route_and_the_steps(shape, chunk):
    inputs = heads(*shape)
    out, state = K.delta_rule_chunked(*inputs, chunk_size=chunk)
    routed, _ = delta_rule_chunked(*inputs, chunk)  # the model's route, the kernel where it runs
    assert np.allclose(np.array(routed), np.array(out), atol=2e-5)
    plain_out, plain_state = plain_delta_rule_chunked(*inputs, chunk)
    step_out, step_state = delta_rule_steps(*inputs)
    assert out.shape == plain_out.shape and state.shape == plain_state.shape and state.dtype == mx.float32
    for got, want in ((out, plain_out), (state, plain_state), (out, step_out), (state, step_state)):
        assert np.allclose(np.array(got), np.array(want), atol=2e-5), float(mx.abs(got - want).max())


def test_strong_decay_and_sixteen_bit_inputs():
    """A chunk whose summed decay underflows float32's exp, and bfloat16 inputs (computed in
    float32: compared with the plain route on the same values in float32)."""
    inputs = heads(1, 2, 96, 16, 8, decay=40.0)
    out, state = K.delta_rule_chunked(*inputs, chunk_size=32)
    step_out, step_state = delta_rule_steps(*inputs)
    assert np.isfinite(np.array(out)).all()
    assert np.allclose(np.array(out), np.array(step_out), atol=2e-5)
    assert np.allclose(np.array(state), np.array(step_state), atol=2e-5)
    halves = [x.astype(mx.bfloat16) for x in heads(1, 2, 40, 16, 8)[:5]] + [heads(1, 2, 40, 16, 8)[5]]
    out, state = K.delta_rule_chunked(*halves, chunk_size=16)
    want_out, want_state = plain_delta_rule_chunked(*[x.astype(mx.float32) for x in halves], 16)
    assert np.allclose(np.array(out.astype(mx.float32)), np.array(want_out), atol=1e-5)
    assert np.allclose(np.array(state), np.array(want_state), atol=1e-5)


def test_gradients_are_the_plain_route_s(monkeypatch):
    monkeypatch.setattr(cpu_deltanet, "kernels", lambda: K)  # the kernel's forward whatever the switch
    inputs = heads(2, 2, 37, 8, 4)

    def through_kernel(*args):
        return cpu_deltanet.delta_rule_chunked(plain_delta_rule_chunked, *args)

    def loss(form):
        def value(*args):
            out, state = form(*args, 16)
            return (out ** 2).sum() + (state * state).sum()
        return value

    got = mx.grad(loss(through_kernel), argnums=tuple(range(6)))(*inputs)
    want = mx.grad(loss(plain_delta_rule_chunked), argnums=tuple(range(6)))(*inputs)
    for g, w in zip(got, want):
        assert np.allclose(np.array(g), np.array(w), atol=1e-5)


CHECK = """
import mlx.core as mx, numpy as np
from mlx_tfm.cpu.kernels import kernels
from mlx_tfm.model.deltanet import delta_rule_chunked, plain_delta_rule_chunked, l2_normalised
assert kernels().isa() == "{isa}", kernels().isa()
mx.random.seed(1)
q = l2_normalised(mx.random.normal((1, 3, 45, 32))) * 32 ** -0.5
k = l2_normalised(mx.random.normal((1, 3, 45, 32)))
v, s = mx.random.normal((1, 3, 45, 20)), mx.random.normal((1, 3, 32, 20)) * 0.1
g, b = -mx.random.uniform(0, 1, (1, 3, 45)), mx.random.uniform(0, 1, (1, 3, 45))
for got, want in zip(delta_rule_chunked(q, k, v, g, b, s, 16), plain_delta_rule_chunked(q, k, v, g, b, s, 16)):
    assert np.allclose(np.array(got), np.array(want), atol=2e-5)
print("ok")
"""


@pytest.mark.parametrize("isa", K.runnable_isas())  # every set this CPU runs (generic on any)
def test_each_instruction_set(isa):
    env = {**os.environ, "MLX_TFM_KERNELS": "1", "MLX_TFM_KERNELS_ISA": isa}
    done = subprocess.run([sys.executable, "-c", CHECK.format(isa=isa)], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
