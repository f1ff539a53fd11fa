"""The 16-bit prompt route: a chunk of positions through a float16 / bfloat16 weight in one
kernel call (``matvec(..., dense=True)``: x made float32 once, the weight's rows made
float32 a block at a time, float32 BLAS), against float32 arithmetic on the same values and
against the plain MLX layers (``generic_routes()``, what Metal and CUDA run).

Like test_cpu_kernels.py these fail, never skip, when the kernels are not built."""

import inspect
import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tfm.cpu import generic_routes, on_cpu
from mlx_tfm.cpu import linear as cpu_linear
from mlx_tfm.cpu.linear import DENSE_FROM_ROWS, Embedding, Linear

try:
    from mlx_tfm.cpu.kernels import _kernels as K
except ImportError as error:  # fail loudly, never skip
    pytest.fail(f"the CPU kernels are not built ({error}): run `pip install -e .` with a C++ compiler and CMake",
                pytrace=False)

HALVES = {"float16": mx.float16, "bfloat16": mx.bfloat16}
# The rounding of an output of each dtype.
OUTPUT_EPS = {mx.float32: 0.0, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


@pytest.fixture(autouse=True)
def on_the_cpu():
    mx.random.seed(7)
    with mx.stream(mx.cpu):
        yield


def assert_within_float32_rounding(result: mx.array, x: mx.array, w: mx.array) -> None:
    """``result`` is x @ w.T computed in float32 on x's and w's values, within float32
    rounding of a k-term sum (4 k 2^-24 times the sum of |terms|) plus the rounding of
    result's own dtype."""
    x32, w32 = np.array(x.astype(mx.float32), dtype=np.float64), np.array(w.astype(mx.float32), dtype=np.float64)
    exact = x32.reshape(-1, x32.shape[-1]) @ w32.T  # float64: the exact value to ~1e-16
    magnitude = np.abs(x32.reshape(-1, x32.shape[-1])) @ np.abs(w32).T
    got = np.array(result.astype(mx.float32)).reshape(exact.shape)
    k = x32.shape[-1]
    bound = 4 * k * 2.0**-24 * magnitude + OUTPUT_EPS[result.dtype] * np.abs(exact) + 1e-30
    excess = np.abs(got - exact) / bound
    assert excess.max() <= 1.0, f"off by {excess.max():.1f}x the float32 bound"


@pytest.mark.parametrize("w_dtype", HALVES)
@pytest.mark.parametrize("x_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("m, n, k", [(16, 37, 577), (17, 2000, 577), (33, 1001, 64), (100, 5, 3), (2, 9, 8)])
def test_dense_half_product_is_float32_arithmetic(w_dtype, x_dtype, m, n, k):
    """Odd sizes; 2000 rows of 577: two blocks of the weight, the second partial."""
    x_type = {"float32": mx.float32, **HALVES}[x_dtype]
    x, w = mx.random.normal((m, k)).astype(x_type), mx.random.normal((n, k)).astype(HALVES[w_dtype])
    result = K.matvec(x, w, dense=True)
    assert result.shape == (m, n) and result.dtype == (x[:1] @ w[:1].T).dtype  # MLX's promotion
    assert_within_float32_rounding(result, x, w)


@pytest.mark.parametrize("w_dtype", HALVES)
def test_dense_half_product_keeps_leading_axes_and_reads_any_layout(w_dtype):
    """x (B, L, k) as a transposed view, w as the transpose of a (k, n) array."""
    x = mx.random.normal((23, 40, 3)).astype(mx.float16).transpose(2, 1, 0)  # (3, 40, 23), not row-contiguous
    w = mx.random.normal((23, 51)).astype(HALVES[w_dtype]).T  # (51, 23), column-major
    result = K.matvec(x, w, dense=True)
    assert result.shape == (3, 40, 51)
    assert_within_float32_rounding(result, x, w)


@pytest.mark.parametrize("dtype", HALVES)
def test_dense_half_product_rounds_as_mlx_does(dtype):
    """To nearest, ties to even, overflow to inf, as MLX's astype (``rounding_case``)."""
    x, w, expected = rounding_case(dtype)
    assert mx.array_equal(K.matvec(x, w, dense=True), expected)


def test_dense_matvec_gradient_is_float32_mlx_s():
    x, w = mx.random.normal((20, 33)).astype(mx.float16), mx.random.normal((17, 33)).astype(mx.float16)
    cotangent = mx.random.normal((20, 17)).astype(mx.float16)
    ours = mx.vjp(lambda a: K.matvec(a, w, dense=True), [x], [cotangent])[1][0]
    reference = (cotangent.astype(mx.float32) @ w.astype(mx.float32)).astype(mx.float16)
    assert ours.dtype == mx.float16 and mx.array_equal(ours, reference)


def test_dense_matvec_shape_errors_are_one_line():
    with pytest.raises(ValueError, match=r"^mlx_tfm kernels: matvec needs x \(\.\.\., k\) and w \(n, k\)$"):
        K.matvec(mx.zeros((20, 8), mx.float16), mx.zeros((4, 9), mx.float16), dense=True)


def expected_route() -> dict[str, int]:
    """The route a 16-bit prompt takes: the kernel where it is in use, else (CI's second
    pass, MLX_TFM_KERNELS=0) MLX ops over float32 blocks."""
    from mlx_tfm.cpu.kernels import kernels

    in_use = kernels() is not None
    return {"dense_half_product": int(in_use), "float32_product": int(not in_use)}


class DenseSpy:
    """Counts the calls into linear.py's dense 16-bit route and its MLX-ops fallback."""

    def __init__(self, monkeypatch):
        self.calls = {"dense_half_product": 0, "float32_product": 0}
        for name in self.calls:
            monkeypatch.setattr(cpu_linear, name, self._counting(name, getattr(cpu_linear, name)))

    def _counting(self, name, function):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return function(*args, **kwargs)

        return counted


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch, length, shape", [(1, DENSE_FROM_ROWS, (64, 96)), (3, 19, (77, 130)),
                                                  (2, 100, (64, 600))])
def test_half_linear_prompts_take_the_kernel_and_equal_the_plain_route(dtype, bias, batch, length, shape, monkeypatch):
    mx.random.seed(0)
    plain = nn.Linear(*shape, bias=bias)
    plain.set_dtype(HALVES[dtype])
    ours = Linear.from_linear(plain)
    x = mx.random.normal((batch, length, shape[0])).astype(HALVES[dtype])
    spy = DenseSpy(monkeypatch)
    fast = ours(x)
    route = expected_route()
    assert on_cpu() and spy.calls == route
    with generic_routes():
        generic = ours(x)
    assert spy.calls == route, "the generic run went through the CPU route"
    assert fast.dtype == generic.dtype == HALVES[dtype] and fast.shape == generic.shape == (batch, length, shape[1])
    tolerance = 3e-2 if dtype == "float16" else 1.5e-1
    np.testing.assert_allclose(np.array(fast.astype(mx.float32)), np.array(generic.astype(mx.float32)),
                               atol=tolerance, rtol=tolerance)
    if route["dense_half_product"]:  # the layer's result is the kernel's, bit for bit
        without_bias = K.matvec(x, plain.weight, dense=True)
        expected = without_bias + plain.bias if bias else without_bias
        assert mx.array_equal(fast, expected)


@pytest.mark.parametrize("dtype", HALVES)
def test_half_tied_head_over_a_prompt_takes_the_kernel(dtype, monkeypatch):
    mx.random.seed(0)
    embedding = nn.Embedding(600, 64)
    embedding.set_dtype(HALVES[dtype])
    ours = Embedding.from_embedding(embedding)
    x = mx.random.normal((2, 30, 64)).astype(HALVES[dtype])
    spy = DenseSpy(monkeypatch)
    fast = ours.as_linear(x)
    assert spy.calls == expected_route()
    with generic_routes():
        generic = ours.as_linear(x)
    tolerance = 3e-2 if dtype == "float16" else 1.5e-1
    np.testing.assert_allclose(np.array(fast.astype(mx.float32)), np.array(generic.astype(mx.float32)),
                               atol=tolerance, rtol=tolerance)


def test_without_the_kernels_half_prompts_take_float32_blocks_of_mlx_ops(monkeypatch):
    """MLX_TFM_KERNELS=0 (or kernels not built): the MLX-ops route, which gives the same
    numbers (float32 products of the same values)."""
    plain = nn.Linear(64, 96)
    plain.set_dtype(mx.float16)
    ours = Linear.from_linear(plain)
    x = mx.random.normal((1, 40, 64)).astype(mx.float16)
    with_kernels = ours(x)
    spy = DenseSpy(monkeypatch)
    monkeypatch.setattr(cpu_linear, "kernels", lambda: None)
    without = ours(x)
    assert spy.calls == {"dense_half_product": 0, "float32_product": 1}
    np.testing.assert_allclose(np.array(with_kernels.astype(mx.float32)), np.array(without.astype(mx.float32)),
                               atol=2e-3, rtol=2e-3)


# Run in a subprocess per instruction set, after rounding_case's source (and HALVES).
ISA_CHECK = r"""
mx.random.seed(3)
report = {"isa": K.isa(), "errors": {}, "rounds_as_mlx": {}}
for name, dtype in (("float16", mx.float16), ("bfloat16", mx.bfloat16)):
    x, w = mx.random.normal((21, 333)).astype(dtype), mx.random.normal((45, 333)).astype(dtype)
    reference = (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(dtype)
    report["errors"][name] = float(mx.abs(K.matvec(x, w, dense=True) - reference).max() / mx.abs(reference).max())
    x, w, expected = rounding_case(name)
    report["rounds_as_mlx"][name] = bool(mx.array_equal(K.matvec(x, w, dense=True), expected))
print(json.dumps(report))
"""


def rounding_case(dtype: str) -> tuple[mx.array, mx.array, mx.array]:
    """x holding every finite value of the format, w = (1 + one unit in the last place) I,
    and MLX's rounding of their float32 product (exact: 24 bits hold the 2 x 11 or 2 x 8
    bits of each product), so the output's rounding is the only one. 67 columns: whole
    vectors and a scalar tail in each row of outputs."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(np.float16).astype(np.float32) if dtype == "float16" else \
        (bits.astype(np.uint32) << 16).view(np.float32)
    values = values[np.isfinite(values)]
    k = 67
    values = np.resize(values, (len(values) // k + 1) * k).reshape(-1, k)
    x = mx.array(values).astype(HALVES[dtype])
    step = 1 + (2.0**-10 if dtype == "float16" else 2.0**-7)
    w = (mx.eye(k) * step).astype(HALVES[dtype])
    return x, w, (x.astype(mx.float32) * step).astype(HALVES[dtype])


def runnable_isas() -> list[str]:
    return list(K.runnable_isas())


@pytest.mark.parametrize("isa", runnable_isas())
def test_every_instruction_set_converts_and_rounds_alike(isa):
    """Each set's conversions (F16C or portable loops; shifts for bfloat16) and rounding."""
    env = {**os.environ, "MLX_TFM_KERNELS_ISA": isa}
    script = "\n".join(["import json", "import mlx.core as mx", "import numpy as np",
                        "from mlx_tfm.cpu.kernels import _kernels as K",
                        "HALVES = {'float16': mx.float16, 'bfloat16': mx.bfloat16}",
                        inspect.getsource(rounding_case), ISA_CHECK])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["isa"] == isa
    assert all(error <= 2.0**-7 for error in report["errors"].values()), report
    assert report["rounds_as_mlx"] == {"float16": True, "bfloat16": True}


class Experts(nn.Module):
    """A stacked layer of experts (experts, out, in), as SwitchGLU's projections hold them."""

    def __init__(self, weight: mx.array, bias: mx.array | None):
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.bias = bias


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("count", [DENSE_FROM_ROWS + 7, 5])
@pytest.mark.parametrize("bias", [True, False])
def test_half_experts_of_a_chunk_take_the_kernel(dtype, count, bias, monkeypatch):
    """by_expert's product of one expert's rows: the dense kernel for a chunk's share, the
    decoding kernel for a few rows; float32 arithmetic on the same values either way, and
    the MLX-ops blocks without the kernels give the same numbers."""
    import mlx_tfm.cpu.experts as cpu_experts

    layer = Experts(mx.random.normal((3, 45, 70)).astype(HALVES[dtype]),
                    mx.random.normal((3, 45)).astype(HALVES[dtype]) if bias else None)
    rows = mx.random.normal((count, 70)).astype(HALVES[dtype])
    calls = []

    class Counting:  # the kernels module, counting calls
        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append((name, kwargs.get("dense"))) or getattr(K, name)(*args, **kwargs)

    monkeypatch.setattr(cpu_experts, "kernels", lambda: Counting())
    ours = cpu_experts.expert_product(rows, layer, 1)
    assert calls == [("blas_found", None), ("matvec", count >= DENSE_FROM_ROWS)]
    if not bias:
        assert_within_float32_rounding(ours, rows, layer.weight[1])
    monkeypatch.setattr(cpu_experts, "kernels", lambda: None)
    blocks = cpu_experts.expert_product(rows, layer, 1)
    assert ours.dtype == blocks.dtype == HALVES[dtype] and ours.shape == blocks.shape == (count, 45)
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(blocks.astype(mx.float32)),
                               atol=2e-2, rtol=2e-2)
