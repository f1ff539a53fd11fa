"""mlx_tfm's C++ CPU kernels (mlx_tfm/cpu/kernels) against MLX's own ops.

Every kernel on random shapes (odd sizes, batches of positions, non-contiguous inputs,
every group size and bit width, every scale and weight dtype), within float32 rounding of
MLX's float32 result; the same for each instruction set the CPU has (AVX-512, AVX2,
portable); and the switch and the reasons ``mlx-tfm info`` gives. The extension must be
built (``pip install -e .``, as .ci/run does): if it is not, these tests fail, they do not
skip. They call it directly, so they run with ``MLX_TFM_KERNELS=0`` too.
"""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_tfm.cpu.kernels as kernels_package

try:
    from mlx_tfm.cpu.kernels import _kernels as K
except ImportError as error:  # fail loudly, never skip
    pytest.fail(f"the CPU kernels are not built ({error}): run `pip install -e .` with a C++ compiler and CMake",
                pytrace=False)

FLOATS = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# The rounding of the output dtype (float32 results are compared at float32 accuracy).
OUTPUT_EPS = {mx.float32: 0.0, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


def assert_close(result: mx.array, reference: mx.array, magnitude: mx.array, k: int) -> None:
    """|result - reference| within float32 rounding of a k-term sum (~k * 2^-24 times the sum
    of |terms|, ``magnitude``), plus the rounding of result's own dtype."""
    result32 = np.array(result.astype(mx.float32))
    reference = np.array(reference.astype(mx.float32))
    magnitude = np.array(magnitude.astype(mx.float32))
    bound = 4 * k * 2.0**-24 * magnitude + OUTPUT_EPS[result.dtype] * np.abs(reference) + 1e-30
    excess = np.abs(result32 - reference) / bound
    assert excess.max() <= 1.0, f"off by {excess.max():.1f}x the float32 bound"


def random(shape, dtype=mx.float32, seed=None) -> mx.array:
    return mx.random.normal(shape).astype(dtype)


@pytest.fixture(autouse=True)
def on_the_cpu():
    mx.random.seed(1)
    with mx.stream(mx.cpu):
        yield


# -- float weights -------------------------------------------------------------------------


@pytest.mark.parametrize("w_dtype", FLOATS)
@pytest.mark.parametrize("x_dtype", FLOATS)
@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 37, 577), (2, 1001, 64), (3, 17, 5), (8, 129, 33), (9, 255, 576), (15, 64, 100)])
def test_matvec_equals_mlx_matmul(w_dtype, x_dtype, m, n, k):
    x, w = random((m, k), FLOATS[x_dtype]), random((n, k), FLOATS[w_dtype])
    result = K.matvec(x, w)
    x32, w32 = x.astype(mx.float32), w.astype(mx.float32)
    assert result.shape == (m, n)
    assert result.dtype == (x[:1] @ w[:1].T).dtype  # MLX's promotion
    assert_close(result, x32 @ w32.T, mx.abs(x32) @ mx.abs(w32).T, k)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_half_precision_value_converts_exactly(dtype):
    """All 65536 bit patterns (subnormals, infinities, NaN) as weights of a one-column
    product with x = 1: the kernel's conversion against MLX's."""
    bits = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16)
    weights = mx.view(bits, FLOATS[dtype]).reshape(-1, 1)
    result = np.array(K.matvec(mx.ones((1, 1)), weights))[0]
    np.testing.assert_array_equal(result, np.array(weights.astype(mx.float32))[:, 0])


def test_matvec_keeps_leading_axes():
    x, w = random((2, 3, 70)), random((45, 70))
    assert_close(K.matvec(x, w), x @ w.T, mx.abs(x) @ mx.abs(w).T, 70)


@pytest.mark.parametrize("layout", ["x transposed", "x strided", "w transposed", "w strided rows", "w row slice"])
def test_matvec_reads_non_contiguous_inputs(layout):
    x, w = random((4, 96)), random((130, 96))
    if layout == "x transposed":
        x = random((96, 4)).T
    elif layout == "x strided":
        x = random((4, 192))[:, ::2]
    elif layout == "w transposed":
        w = random((96, 130)).T
    elif layout == "w strided rows":
        w = random((260, 96))[::2]
    else:
        w = random((300, 96))[17:147]  # row-contiguous, at an offset
    assert_close(K.matvec(x, w), x @ w.T, mx.abs(x) @ mx.abs(w).T, 96)


def test_matvec_large_enough_for_every_thread():
    x, w = random((1, 576)), random((49152 // 4, 576), mx.float16)
    w32 = w.astype(mx.float32)
    assert_close(K.matvec(x, w), x @ w32.T, mx.abs(x) @ mx.abs(w32).T, 576)


# -- affine quantized weights --------------------------------------------------------------


def quantized(n: int, k: int, group_size: int, bits: int, scale_dtype=mx.float32):
    weight, scales, biases = mx.quantize(random((n, k)), group_size=group_size, bits=bits)
    return weight, scales.astype(scale_dtype), biases.astype(scale_dtype)


def dequantized(weight, scales, biases, group_size, bits) -> mx.array:
    return mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32),
                         group_size=group_size, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", FLOATS)
@pytest.mark.parametrize("m, n, groups", [(1, 37, 3), (1, 1536, 9), (2, 1, 1), (5, 129, 5), (8, 64, 2), (11, 333, 7)])
def test_quantized_matvec_equals_mlx(bits, group_size, scale_dtype, m, n, groups):
    k = groups * group_size
    weight, scales, biases = quantized(n, k, group_size, bits, FLOATS[scale_dtype])
    x = random((m, k))
    result = K.quantized_matvec(x, weight, scales, biases, group_size=group_size, bits=bits)
    w32 = dequantized(weight, scales, biases, group_size, bits)
    assert result.shape == (m, n) and result.dtype == (x[:1, :1] * scales[:1, :1]).dtype
    assert_close(result, x @ w32.T, mx.abs(x) @ mx.abs(w32).T, k)
    if scale_dtype == "float32":  # MLX's own quantized product, too
        mlx_result = mx.quantized_matmul(x, weight, scales, biases, group_size=group_size, bits=bits)
        assert_close(result, mlx_result, mx.abs(x) @ mx.abs(w32).T, 2 * k)


@pytest.mark.parametrize("x_dtype", ["float16", "bfloat16"])
def test_quantized_matvec_half_inputs(x_dtype):
    weight, scales, biases = quantized(200, 256, 64, 4, mx.float16)
    x = random((3, 256), FLOATS[x_dtype])
    result = K.quantized_matvec(x, weight, scales, biases, group_size=64, bits=4)
    w32, x32 = dequantized(weight, scales, biases, 64, 4), x.astype(mx.float32)
    assert result.dtype == (x[:1] * scales[:1, :1]).dtype
    assert_close(result, x32 @ w32.T, mx.abs(x32) @ mx.abs(w32).T, 256)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout", ["x transposed", "rows strided", "row slice", "scales transposed"])
def test_quantized_matvec_reads_non_contiguous_inputs(bits, layout):
    weight, scales, biases = quantized(90, 256, 64, bits)
    x = random((3, 256))
    if layout == "x transposed":
        x = random((256, 3)).T
    elif layout == "rows strided":
        weight, scales, biases = (a[::2] for a in (weight, scales, biases))
    elif layout == "row slice":
        weight, scales, biases = (a[13:77] for a in (weight, scales, biases))
    else:
        scales = mx.array(np.ascontiguousarray(np.array(scales).T)).T  # same values, column-major
    result = K.quantized_matvec(x, weight, scales, biases, group_size=64, bits=bits)
    w32 = dequantized(weight, scales, biases, 64, bits)
    assert_close(result, x @ w32.T, mx.abs(x) @ mx.abs(w32).T, 256)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", FLOATS)
def test_quantized_rows_equal_mlx_dequantize(bits, group_size, scale_dtype):
    weight, scales, biases = quantized(301, 3 * group_size, group_size, bits, FLOATS[scale_dtype])
    ids = mx.array([[0, 300, 5], [7, 7, 150]], dtype=mx.uint32)
    result = K.quantized_rows(ids, weight, scales, biases, group_size=group_size, bits=bits)
    # MLX's dequantize in float32 (half scales are exact in it); the kernel rounds that once
    # to the scales' dtype, where MLX's half dequantize rounds the product and the sum.
    reference = dequantized(weight, scales, biases, group_size, bits)[ids]
    assert result.shape == (2, 3, 3 * group_size) and result.dtype == FLOATS[scale_dtype]
    assert_close(result, reference, mx.abs(reference), 1)


def test_quantized_rows_take_int32_ids_and_strided_ids():
    weight, scales, biases = quantized(50, 64, 32, 4)
    ids = mx.array([[3, 9], [4, 49], [1, 2]], dtype=mx.int32).T  # (2, 3), not contiguous
    result = K.quantized_rows(ids, weight, scales, biases, group_size=32, bits=4)
    reference = mx.dequantize(weight, scales, biases, group_size=32, bits=4)[ids]
    assert_close(result, reference, mx.abs(reference), 1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", FLOATS)
@pytest.mark.parametrize("m, n", [(96, 61), (181, 700), (3, 9000)])
def test_dense_quantized_product_equals_mlx(bits, group_size, scale_dtype, m, n):
    """A prompt's product through float32 BLAS, w dequantized by blocks of rows (9000 rows
    of 128: more than one block), rows sliced at an offset (not at the buffer's start)."""
    k = 128
    weight, scales, biases = quantized(n + 7, k, group_size, bits, FLOATS[scale_dtype])
    weight, scales, biases = (a[5 : n + 5] for a in (weight, scales, biases))
    x = random((m, k))
    result = K.quantized_matvec(x, weight, scales, biases, group_size=group_size, bits=bits, dense=True)
    w32 = dequantized(weight, scales, biases, group_size, bits)
    assert result.shape == (m, n) and result.dtype == (x[:1, :1] * scales[:1, :1]).dtype
    # scale * q + bias, one rounding (fused) where MLX has two, then a k-term sum
    magnitude = mx.abs(x) @ dequantized(weight, mx.abs(scales), mx.abs(biases), group_size, bits).T
    assert_close(result, x @ w32.T, magnitude, k + 1)


# -- attention of one query (a decoding step) ----------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("batch, heads, kv_heads, positions, head_dim", [
    (1, 9, 3, 245, 64), (2, 4, 4, 1, 17), (1, 8, 1, 1000, 128), (3, 6, 2, 33, 80), (1, 1, 1, 7, 3)])
def test_one_query_attention_equals_mlx_sdpa(dtype, batch, heads, kv_heads, positions, head_dim):
    queries = random((batch, heads, 1, head_dim), FLOATS[dtype])
    cache = random((batch, kv_heads, positions + 11, head_dim), FLOATS[dtype])
    keys = cache[:, :, :positions]  # a cache's filled part: strided, not contiguous
    values = random((batch, kv_heads, positions, head_dim), FLOATS[dtype])
    scale = head_dim**-0.5
    result = K.attention(queries, keys, values, scale=scale)
    q32, k32, v32 = (a.astype(mx.float32) for a in (queries, keys, values))
    reference = mx.fast.scaled_dot_product_attention(q32, k32, v32, scale=scale)
    assert result.shape == queries.shape and result.dtype == queries.dtype
    # A weighted mean of the values: rounding relative to the largest of them.
    assert_close(result, reference, mx.broadcast_to(mx.abs(v32).max(), reference.shape), positions + head_dim)


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (12, 2), (7, 1)])
def test_one_query_attention_with_peaked_weights(heads, kv_heads):
    """Large queries: most weights are below float32's normal range (flushed to 0 by the
    kernel), a few carry the mass; head groups of 1, 6 and 7 (blocks of 4 query heads)."""
    queries = random((2, heads, 1, 64)) * 30
    keys, values = random((2, kv_heads, 300, 64)), random((2, kv_heads, 300, 64))
    result = K.attention(queries, keys, values, scale=0.125)
    reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125)
    assert_close(result, reference, mx.broadcast_to(mx.abs(values).max(), reference.shape), 364)


@pytest.mark.parametrize("mask_rows", [3, 1])
def test_one_query_attention_with_a_row_mask(mask_rows):
    """Rows that start at different slots (a batch of decoding streams): each attends to
    its own positions only; a row that sees nothing gives zeros."""
    queries, keys, values = random((3, 6, 1, 32)), random((3, 2, 40, 32)), random((3, 2, 40, 32))
    starts = mx.array([0, 17, 39][:mask_rows])[:, None, None, None]
    mask = mx.arange(40)[None, None, None, :] >= starts  # (rows, 1, 1, 40)
    result = K.attention(queries, keys, values, scale=0.2, mask=mask)
    reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.2, mask=mask)
    assert_close(result, reference, mx.broadcast_to(mx.abs(values).max(), reference.shape), 72)
    blind = K.attention(queries, keys, values, scale=0.2, mask=mx.zeros((1, 1, 1, 40), mx.bool_))
    assert not np.array(blind).any()


def test_one_query_attention_reads_values_with_any_strides():
    queries, keys = random((1, 4, 1, 16)), random((1, 2, 50, 16))
    values = random((1, 2, 16, 50)).swapaxes(2, 3)  # the head axis is not contiguous
    reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25)
    assert_close(K.attention(queries, keys, values, scale=0.25), reference,
                 mx.broadcast_to(mx.abs(values).max(), reference.shape), 66)


# -- attention of several queries (a prompt, an encoder) ---------------------------------------


def causal_rows(queries: int, positions: int) -> mx.array:
    """(L, S): query l sees positions up to S - L + l, written out for the reference."""
    return mx.arange(positions)[None, :] <= mx.arange(positions - queries, positions)[:, None]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("batch, heads, kv_heads, queries, positions, head_dim", [
    (1, 9, 3, 180, 180, 64), (2, 4, 2, 7, 30, 16), (1, 8, 8, 33, 100, 32), (1, 9, 3, 5, 300, 64),
    (2, 6, 1, 70, 70, 24), (1, 3, 3, 130, 1000, 80), (1, 1, 1, 2, 2, 3), (2, 12, 4, 65, 129, 128)])
def test_causal_attention_equals_mlx_sdpa(dtype, batch, heads, kv_heads, queries, positions, head_dim):
    """A prompt's chunk at the end of the cache: query blocks that end mid-tile, tiles of keys
    cut short, groups of 1-3 query heads per KV head, keys strided (a cache's filled part)."""
    q = random((batch, heads, queries, head_dim), FLOATS[dtype])
    keys = random((batch, kv_heads, positions + 5, head_dim), FLOATS[dtype])[:, :, :positions]
    values = random((batch, kv_heads, positions, head_dim), FLOATS[dtype])
    scale = head_dim**-0.5
    result = K.attention(q, keys, values, scale=scale, causal=True)
    q32, k32, v32 = (a.astype(mx.float32) for a in (q, keys, values))
    reference = mx.fast.scaled_dot_product_attention(q32, k32, v32, scale=scale, mask=causal_rows(queries, positions))
    assert result.shape == q.shape and result.dtype == q.dtype
    assert_close(result, reference, mx.broadcast_to(mx.abs(v32).max(), reference.shape), positions + head_dim)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_rows", [2, 1])
def test_several_queries_with_a_row_mask(causal, mask_rows):
    """An encoder's padding (every query sees the same positions of its row), alone or with
    the causal mask; a row that sees nothing gives zeros."""
    q, keys, values = random((2, 6, 20, 32)), random((2, 2, 40, 32)), random((2, 2, 40, 32))
    lengths = mx.array([40, 23][:mask_rows])[:, None, None, None]
    mask = mx.arange(40)[None, None, None, :] < lengths  # (rows, 1, 1, 40)
    result = K.attention(q, keys, values, scale=0.2, mask=mask, causal=causal)
    both = mask & causal_rows(20, 40) if causal else mask
    reference = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.2, mask=both)
    assert_close(result, reference, mx.broadcast_to(mx.abs(values).max(), reference.shape), 72)
    blind = K.attention(q, keys, values, scale=0.2, mask=mx.zeros((1, 1, 1, 40), mx.bool_), causal=causal)
    assert not np.array(blind).any()


def test_several_queries_with_peaked_weights_and_strided_inputs():
    """Large queries (most weights flushed to 0), queries and values not contiguous."""
    q = (random((1, 20, 8, 64)) * 30).swapaxes(1, 2)  # (1, 8, 20, 64), heads axis strided
    keys, values = random((1, 2, 300, 64)), random((1, 2, 64, 300)).swapaxes(2, 3)
    result = K.attention(q, keys, values, scale=0.125, causal=True)
    reference = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=causal_rows(20, 300))
    assert_close(result, reference, mx.broadcast_to(mx.abs(values).max(), reference.shape), 364)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_gradients_are_mlx_s(masked):
    """Training through the kernel: the gradients of the fused op with the same mask."""
    q, keys, values = random((2, 4, 9, 16)), random((2, 2, 12, 16)), random((2, 2, 12, 16))
    rows = mx.arange(12)[None, None, None, :] >= mx.array([0, 2])[:, None, None, None]
    mask = rows if masked else None
    both = rows & causal_rows(9, 12) if masked else causal_rows(9, 12)
    cotangent = random((2, 4, 9, 16))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * cotangent).sum()

    ours = mx.grad(loss(lambda q, k, v: K.attention(q, k, v, scale=0.3, mask=mask, causal=True)), argnums=(0, 1, 2))
    theirs = mx.grad(loss(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=both)),
                     argnums=(0, 1, 2))
    for a, b in zip(ours(q, keys, values), theirs(q, keys, values)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


# -- the kernels inside MLX graphs ---------------------------------------------------------


def dequantized_float64(weight, scales, biases, group_size: int, bits: int) -> np.ndarray:
    """MLX's affine layout decoded in numpy, apart from MLX: value j of a row in bits
    j*bits.. of its little-endian uint32 words, times its group's scale, plus its bias."""
    words = np.array(weight).astype(np.uint64)  # (n, k * bits / 32)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)[None, None, :]
    q = ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)  # (n, k)
    groups = lambda a: np.repeat(np.array(a.astype(mx.float32), dtype=np.float64), group_size, axis=1)  # noqa: E731
    return q * groups(scales) + groups(biases)


def test_kernels_compose_lazily_with_mlx_ops():
    weight, scales, biases = quantized(64, 64, 32, 4)
    x, w = random((1, 64)), random((10, 64))
    # y feeds the next product: the graph runs in order on the CPU stream.
    y = K.quantized_matvec(mx.tanh(x), weight, scales, biases, group_size=32, bits=4)
    z = K.matvec(y * 2, w)
    mx.eval(z)
    # In float64, from the weights decoded apart from MLX. Bounds: float32 rounding of a
    # 64-term sum (4 * 64 units of 2^-24 of the sum of |terms|) plus tanh's own (4 units),
    # then y's error through the second product, plus that product's rounding.
    t, w64 = np.tanh(np.array(x, dtype=np.float64)), np.array(w, dtype=np.float64)
    w_q = dequantized_float64(weight, scales, biases, 32, 4)
    y_ref, z_ref = t @ w_q.T, 2 * (t @ w_q.T) @ w64.T
    y_bound = (4 * 64 + 4) * 2.0**-24 * (np.abs(t) @ np.abs(w_q).T)
    z_bound = 2 * y_bound @ np.abs(w64).T + 4 * 64 * 2.0**-24 * (np.abs(2 * y_ref) @ np.abs(w64).T)
    assert (np.abs(np.array(y) - y_ref) <= y_bound).all()
    assert (np.abs(np.array(z) - z_ref) <= z_bound).all()


def test_matvec_gradient_is_mlx_s():
    x, w = random((2, 48)), random((20, 48))
    grad_x, grad_w = mx.grad(lambda a, b: K.matvec(a, b).sum(), argnums=(0, 1))(x, w)
    ref_x, ref_w = mx.grad(lambda a, b: (a @ b.T).sum(), argnums=(0, 1))(x, w)
    assert np.allclose(np.array(grad_x), np.array(ref_x), atol=1e-5)
    assert np.allclose(np.array(grad_w), np.array(ref_w), atol=1e-5)


def test_quantized_matvec_gradient_wrt_x_is_mlx_s():
    weight, scales, biases = quantized(40, 64, 32, 8)
    x = random((3, 64))
    grad = mx.grad(lambda a: K.quantized_matvec(a, weight, scales, biases, group_size=32, bits=8).sum())(x)
    ref = mx.grad(lambda a: mx.quantized_matmul(a, weight, scales, biases, group_size=32, bits=8).sum())(x)
    assert np.allclose(np.array(grad), np.array(ref), atol=1e-4)


def test_dense_quantized_product_gradient_is_mlx_s():
    """A prompt's quantized product in training: the input's gradient through float32 BLAS
    against the dequantized weight, as MLX's own product gives it."""
    weight, scales, biases = quantized(40, 64, 32, 4)
    x = random((100, 64))
    grad = mx.grad(lambda a: (K.quantized_matvec(a, weight, scales, biases, group_size=32, bits=4, dense=True)
                              * mx.arange(40)).sum())(x)
    ref = mx.grad(lambda a: (mx.quantized_matmul(a, weight, scales, biases, group_size=32, bits=4)
                             * mx.arange(40)).sum())(x)
    assert np.allclose(np.array(grad), np.array(ref), atol=1e-3)


# -- several products of one input (a layer's q, k, v; its gate and up) ------------------------


@pytest.mark.parametrize("w_dtype", FLOATS)
@pytest.mark.parametrize("m", [1, 5, 15])
def test_fused_products_equal_each_product(w_dtype, m):
    x = random((m, 100))
    weights = [random((n, 100), FLOATS[w_dtype]) for n in (96, 33, 33)]
    outputs = K.fused_products(x, weights)
    assert len(outputs) == 3
    for y, w in zip(outputs, weights):
        reference = x @ w.astype(mx.float32).T
        assert y.shape == reference.shape and y.dtype == mx.float32  # x float32 promotes every w
        assert_close(y, reference, mx.abs(x) @ mx.abs(w.astype(mx.float32)).T, 100)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_fused_quantized_products_equal_each_product(bits, group_size):
    x = random((3, 1, 256))
    layers = [quantized(n, 256, group_size, bits) for n in (64, 17, 17)]
    outputs = K.fused_products(x, [a for layer in layers for a in layer], group_size=group_size, bits=bits)
    for y, layer in zip(outputs, layers):
        dense = dequantized(*layer, group_size, bits)
        assert_close(y, x @ dense.T, mx.abs(x) @ mx.abs(dense).T, 256)


@pytest.mark.parametrize("bits", [0, 4])
def test_gated_products_are_silu_of_gate_times_up(bits):
    x = random((2, 128)) * 0.2
    if bits:
        gate, up = quantized(80, 128, 64, bits), quantized(80, 128, 64, bits)
        arrays, dense = [*gate, *up], (dequantized(*gate, 64, bits), dequantized(*up, 64, bits))
    else:
        gate, up = random((80, 128)), random((80, 128))
        arrays, dense = [gate, up], (gate, up)
    (result,) = K.fused_products(x, arrays, group_size=64 if bits else 0, bits=bits, gated=True)
    g64, u64 = (np.array(x).astype(np.float64) @ np.array(w).astype(np.float64).T for w in dense)
    # the products' float32 rounding, then silu: relative to the terms' magnitude
    magnitude = np.abs(g64 * u64) + np.abs(np.array(x)) @ np.abs(np.array(dense[0])).T * np.abs(u64)
    assert_within(result, g64 * u64 / (1 + np.exp(-g64)), 128 * 8, magnitude)


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("traditional, dims", [(False, 32), (True, 32), (False, 16)])
@pytest.mark.parametrize("offset", [7, [3, 90]])
def test_fused_products_in_heads_with_rope_equal_mlx(bits, traditional, dims, offset):
    """One position's q, k, v as (B, heads, 1, head_dim), q and k rotated (partial rotary
    when dims < head_dim): the products, reshaped and transposed, then mx.fast.rope."""
    x = random((2, 1, 128)) * 0.3
    shapes, heads = (128, 64, 64), [4, 2, 2]
    if bits:
        layers = [quantized(n, 128, 64, bits) for n in shapes]
        arrays, dense = [a for layer in layers for a in layer], [dequantized(*layer, 64, bits) for layer in layers]
    else:
        arrays = dense = [random((n, 128)) for n in shapes]
    periods, offset = rope_periods(dims, 1000.0), mx.array(offset)
    outputs = K.fused_products(x, arrays, group_size=64 if bits else 0, bits=bits, heads=heads, offset=offset,
                               freqs=periods, rope_dims=dims, traditional=traditional, rope_scale=0.5)
    for i, (y, w, h) in enumerate(zip(outputs, dense, heads)):
        expected = (x @ w.T).reshape(2, 1, h, 32).transpose(0, 2, 1, 3)  # (B, 1, H * D) -> (B, H, 1, D)
        if i < 2:
            expected = mx.fast.rope(expected, dims, traditional=traditional, base=None, scale=0.5, offset=offset,
                                    freqs=periods)
        assert y.shape == expected.shape == (2, h, 1, 32)
        magnitude = np.linalg.norm(np.array(expected), axis=-1, keepdims=True)
        assert_within(y, expected, 4096, magnitude)


def test_fused_products_gradient_is_mlx_s():
    x, weights = random((2, 48)), [random((20, 48)), random((7, 48))]
    got = mx.grad(lambda a, w: sum((y ** 2).sum() for y in K.fused_products(a, [w, weights[1]])), argnums=(0, 1))(
        x, weights[0])
    want = mx.grad(lambda a, w: ((a @ w.T) ** 2).sum() + ((a @ weights[1].T) ** 2).sum(), argnums=(0, 1))(
        x, weights[0])
    for g, r in zip(got, want):
        assert np.allclose(np.array(g), np.array(r), atol=1e-3, rtol=1e-5)


# -- pointwise ops: RMSNorm, RoPE, silu(gate) * up -------------------------------------------


def assert_within(result: mx.array, reference, ulps: float, magnitude=None) -> None:
    """|result - reference| within ``ulps`` units of float32 rounding of ``magnitude`` (the
    reference's own by default), plus the rounding of result's own dtype, twice (MLX rounds
    intermediates in it)."""
    result32 = np.array(result.astype(mx.float32))
    reference = np.array(reference.astype(mx.float32)) if isinstance(reference, mx.array) else reference
    magnitude = np.abs(reference) if magnitude is None else magnitude
    bound = (ulps * 2.0**-24 + 2 * OUTPUT_EPS[result.dtype]) * (magnitude + 1e-3)
    excess = np.abs(result32 - reference) / bound
    assert excess.max() <= 1.0, f"off by {excess.max():.1f}x the bound"


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1, 576), (16, 1, 576), (1, 37, 100), (2, 3, 5, 7), (4, 1), (1, 301, 2048)])
def test_rms_norm_equals_mlx_fast_rms_norm(dtype, shape):
    x = random(shape, FLOATS[dtype]) * 3
    weight = (random((shape[-1],)) * 0.5 + 1).astype(FLOATS[dtype])
    result = K.rms_norm(x, weight, eps=1e-5)
    assert result.dtype == x.dtype and result.shape == x.shape
    assert_within(result, mx.fast.rms_norm(x, weight, 1e-5), 64)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(3, 70), (2, 301, 2048)])  # one piece; a prompt's rows over every core
def test_half_rms_norm_rounds_as_mlx(dtype, shape):
    # MLX rounds the normalized values to the output's type, then multiplies by the weight in
    # it: the kernel's own float32 normalization (a float32 weight of ones keeps it float32,
    # unrounded) through those two roundings in MLX ops must be the half result bit for bit.
    x = random(shape, dtype) * 3
    weight = (random((shape[-1],)) * 0.5 + 1).astype(dtype)
    normalized = K.rms_norm(x, mx.ones((shape[-1],)), eps=1e-5)
    assert normalized.dtype == mx.float32
    expected = normalized.astype(dtype) * weight
    assert np.array_equal(np.array(K.rms_norm(x, weight, eps=1e-5).astype(mx.float32)),
                          np.array(expected.astype(mx.float32)))
    # a strided input (rows of a transpose) reads the same values as its contiguous copy
    strided = x.swapaxes(0, -2)
    contiguous = mx.array(np.array(strided.astype(mx.float32))).astype(dtype)
    assert np.array_equal(np.array(K.rms_norm(strided, weight, eps=1e-5).astype(mx.float32)),
                          np.array(K.rms_norm(contiguous, weight, eps=1e-5).astype(mx.float32)))


def test_rms_norm_against_the_formula_and_with_a_float32_weight():
    x = random((3, 70), mx.float16)
    weight = random((70,))
    result = K.rms_norm(x, weight, eps=1e-6)
    assert result.dtype == mx.float32  # promoted, as mx.fast.rms_norm
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * np.array(weight)
    assert np.allclose(np.array(result), expected, rtol=1e-5, atol=1e-6)


def rope_periods(dims: int, base: float) -> mx.array:
    return mx.array((base ** (np.arange(0, dims, 2) / dims)).astype(np.float32))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims, head_dim", [(64, 64), (32, 64), (6, 10)])
@pytest.mark.parametrize("offset", [0, 1000, [3, 70, 0]])
def test_rope_equals_mlx_fast_rope(dtype, traditional, dims, head_dim, offset):
    # (3, L, H, D) transposed to (3, H, L, D): the layout the attention layer hands over
    x = random((3, 5, 4, head_dim), FLOATS[dtype]).transpose(0, 2, 1, 3)
    freqs, offset = rope_periods(dims, 10000.0), mx.array(offset)
    result = K.rope(x, offset, freqs, dims=dims, traditional=traditional, scale=0.5)
    reference = mx.fast.rope(x, dims, traditional=traditional, base=None, scale=0.5, offset=offset, freqs=freqs)
    assert result.dtype == x.dtype and result.shape == x.shape
    # A rotation keeps each pair's length: errors scale with it, not with the (possibly
    # cancelled) output. The angles reach 500 radians: sin and cos of a float32 angle
    # differ by a few ulps of it.
    pair_length = np.linalg.norm(np.array(x.astype(mx.float32)), axis=-1, keepdims=True)
    assert_within(result, reference, 4096, pair_length)


def test_rope_against_the_rotation_formula():
    """Rotate-half RoPE from its definition, in float64: pair (i, i + d/2) turned by
    position * scale / period_i."""
    x = random((2, 3, 4, 8))
    periods = np.array([1.0, 10.0, 100.0, 1000.0])
    result = np.array(K.rope(x, mx.array([5, 9]), mx.array(periods.astype(np.float32)), dims=8, traditional=False,
                             scale=1.0))
    x64 = np.array(x).astype(np.float64)
    positions = np.array([5, 9])[:, None, None, None] + np.arange(4)[None, None, :, None]  # (B, 1, L, 1)
    angle = positions / periods  # (B, 1, L, 4)
    first, second = x64[..., :4], x64[..., 4:]
    expected = np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                               first * np.sin(angle) + second * np.cos(angle)], axis=-1)
    assert np.allclose(result, expected, atol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1, 1536), (16, 1, 1536), (1, 181, 1536), (3, 7)])
def test_silu_mul_equals_mlx_ops(dtype, shape):
    gate, up = random(shape, FLOATS[dtype]) * 4, random(shape, FLOATS[dtype])
    result = K.silu_mul(gate, up)
    assert result.dtype == gate.dtype and result.shape == gate.shape
    # against float64 (MLX's own float32 sigmoid is off by up to ~15 ulps here)
    g64, u64 = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (gate, up))
    assert_within(result, g64 * u64 / (1 + np.exp(-g64)), 8)


def test_silu_mul_at_the_ends_of_float32():
    gate = mx.array([-1e4, -100.0, -88.5, -20.0, -1e-6, 0.0, 1e-6, 20.0, 88.5, 100.0, 1e4])
    up = mx.full(gate.shape, 1.5)
    result, reference = np.array(K.silu_mul(gate, up)), np.array(gate * mx.sigmoid(gate) * up)
    assert np.isfinite(result).all()
    assert np.allclose(result, reference, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", FLOATS)
def test_silu_mul_writes_over_a_gate_nothing_else_reads(dtype):
    """A gate only the product reads gives it its memory (a prompt's FFN holds two of its
    activations at a time, not three); the values are those of a fresh output, bit for bit."""
    x = random((1 << 18,), FLOATS[dtype])
    mx.eval(x)
    held_gate, up = x + 1, x * 2
    mx.eval(held_gate, up)
    fresh = K.silu_mul(held_gate, up)  # the gate is still read (held here): a new buffer
    mx.eval(fresh)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    donated = K.silu_mul(x + 1, x * 2)  # both inputs made in the graph, read by it only
    mx.eval(donated)
    # gate and up (and the two scalars): the result is in the gate, not a third buffer
    assert mx.get_peak_memory() - before < 2.5 * x.nbytes
    assert np.array_equal(np.array(donated.astype(mx.float32)), np.array(fresh.astype(mx.float32)))


def test_silu_mul_leaves_a_gate_still_read_as_it_was():
    gate, up = random((4, 1536)), random((4, 1536))
    mx.eval(gate, up)
    before = np.array(gate)
    result = K.silu_mul(gate, up)
    doubled = gate * 2  # read after the product
    mx.eval(result, doubled)
    assert np.array_equal(np.array(gate), before)
    assert np.array_equal(np.array(doubled), before * 2)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1, 32000), (1, 181, 4096), (3, 7)])
def test_soft_cap_against_float64(dtype, shape):
    """Values from -12 to 12 times the cap: both of tanh's forms (the series below a quarter
    of the cap, the exponential above) and its flat ends."""
    x = random(shape, FLOATS[dtype]) * 100
    result = K.soft_cap(x, cap=30.0)
    assert result.dtype == x.dtype and result.shape == x.shape
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    # x / cap and the product by cap round too: MLX's own route is off by up to 3.3 ulps, ours 4
    assert_within(result, 30.0 * np.tanh(x64 / 30.0), 5)


def test_soft_cap_near_zero_and_at_the_ends():
    """Where 1 - e^-2y loses its digits the series keeps them; NaN stays NaN (a broken
    model's logits must reach the NaN check), infinities go to +-cap."""
    x = mx.array(np.concatenate([np.geomspace(1e-30, 1e3, 400), -np.geomspace(1e-30, 1e3, 400)]).astype(np.float32))
    x64 = np.array(x).astype(np.float64)
    expected = 5.0 * np.tanh(x64 / 5.0)
    assert (np.abs(np.array(K.soft_cap(x, cap=5.0)) - expected) <= 5 * 2.0**-24 * np.abs(expected)).all()
    ends = np.array(K.soft_cap(mx.array([float("nan"), float("inf"), -float("inf"), 0.0] * 5), cap=5.0))
    assert np.isnan(ends[0::4]).all() and (ends[1::4] == 5.0).all() and (ends[2::4] == -5.0).all()
    assert (ends[3::4] == 0.0).all()


def test_a_capped_model_head_equals_the_plain_route(monkeypatch):
    """The model's head through the kernel and through MLX's ops (as Metal and CUDA run it)."""
    from mlx_tfm.cpu import pointwise
    from mlx_tfm.model.config import ModelArgs
    from mlx_tfm.model.transformer import Model

    mx.random.seed(3)
    args = ModelArgs.from_dict({"model_type": "gemma2", "hidden_size": 32, "num_hidden_layers": 1,
                                "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                                "head_dim": 16, "vocab_size": 300, "final_logit_softcapping": 2.0})
    model = Model(args)
    hidden = random((2, 5, 32)) * 8
    fast = model.head(hidden)
    monkeypatch.setattr(pointwise, "in_use", lambda: False)
    plain = model.head(hidden)
    assert np.abs(np.array(plain)).max() > 1.9  # the cap is reached, not only its linear middle
    assert np.allclose(np.array(fast), np.array(plain), atol=2e-6)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 49152), (16, 49152), (2, 3, 1000), (5,)])
def test_logsumexp_against_float64(dtype, shape):
    x = random(shape, FLOATS[dtype]) * 8
    result = K.logsumexp(x)
    assert result.dtype == x.dtype and result.shape == (*shape[:-1], 1)
    x64 = np.array(x.astype(mx.float32)).astype(np.float64)
    top = x64.max(-1, keepdims=True)
    expected = top + np.log(np.exp(x64 - top).sum(-1, keepdims=True))
    # a sum of n terms in float32: n * 2^-24 of the result at worst, far less in practice
    assert_within(result, expected, 64)


def test_logsumexp_of_nan_and_banned_rows():
    x = mx.array([[1.0, float("nan"), 2.0], [float("-inf")] * 3, [0.0, float("-inf"), 1.0]])
    result = np.array(K.logsumexp(x))[:, 0]
    assert np.isnan(result[0]) and result[1] == -np.inf
    assert abs(result[2] - np.log(1 + np.e)) < 1e-6


def test_pointwise_gradients_are_mlx_s():
    x, weight = random((2, 3, 40)), random((40,))
    got = mx.grad(lambda a, w: (K.rms_norm(a, w, eps=1e-5) ** 2).sum(), argnums=(0, 1))(x, weight)
    want = mx.grad(lambda a, w: (mx.fast.rms_norm(a, w, 1e-5) ** 2).sum(), argnums=(0, 1))(x, weight)
    for g, r in zip(got, want):
        assert np.allclose(np.array(g), np.array(r), atol=1e-5)
    q, freqs, offset = random((2, 2, 3, 8)), rope_periods(8, 100.0), mx.array([1, 4])
    got = mx.grad(lambda a: (K.rope(a, offset, freqs, dims=8, traditional=False, scale=1.0) * q).sum())(q)
    want = mx.grad(lambda a: (mx.fast.rope(a, 8, traditional=False, base=None, scale=1.0, offset=offset,
                                           freqs=freqs) * q).sum())(q)
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    logits = random((3, 70))
    got = mx.grad(lambda a: (K.logsumexp(a) ** 2).sum())(logits)
    want = mx.grad(lambda a: (mx.logsumexp(a, axis=-1, keepdims=True) ** 2).sum())(logits)
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    got = mx.grad(lambda a: (K.soft_cap(a, cap=2.0) ** 2).sum())(logits)
    want = mx.grad(lambda a: ((mx.tanh(a / 2.0) * 2.0) ** 2).sum())(logits)
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    gate, up = random((3, 50)), random((3, 50))
    got = mx.grad(lambda g, u: (K.silu_mul(g, u) ** 2).sum(), argnums=(0, 1))(gate, up)
    want = mx.grad(lambda g, u: ((g * mx.sigmoid(g) * u) ** 2).sum(), argnums=(0, 1))(gate, up)
    for g, r in zip(got, want):
        assert np.allclose(np.array(g), np.array(r), atol=1e-4)


# -- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda: K.matvec(random((2, 5)), random((3, 6))), "matvec needs x"),
    (lambda: K.soft_cap(random((2, 5)), cap=0.0), "a cap above 0"),
    (lambda: K.matvec(random((2, 5)), mx.zeros((3, 5), dtype=mx.int32)), "float32, float16 or bfloat16"),
    (lambda: K.quantized_matvec(random((1, 64)), *quantized(8, 64, 32, 4), group_size=32, bits=3), "bits must be 4 or 8"),
    (lambda: K.quantized_matvec(random((1, 64)), *quantized(8, 64, 32, 4), group_size=16, bits=4), "group_size must be"),
    (lambda: K.quantized_matvec(random((1, 60)), *quantized(8, 64, 32, 4), group_size=32, bits=4), "last axis must match"),
    (lambda: K.quantized_matvec(random((1, 64)), *quantized(8, 64, 32, 4), group_size=64, bits=4), "scales and biases must be"),
    (lambda: K.quantized_rows(random((2,)), *quantized(8, 64, 32, 4), group_size=32, bits=4), "ids must be integers"),
    (lambda: K.rms_norm(random((2, 5)), random((6,)), eps=1e-5), "rms_norm needs x"),
    (lambda: K.rope(random((2, 5, 8)), mx.array(0), rope_periods(8, 1e4), dims=8, traditional=False, scale=1.0),
     "rope needs x"),
    (lambda: K.rope(random((2, 1, 5, 8)), mx.array(0), rope_periods(6, 1e4), dims=8, traditional=False, scale=1.0),
     "float32 freqs"),
    (lambda: K.rope(random((2, 1, 5, 8)), mx.array([1, 2, 3]), rope_periods(8, 1e4), dims=8, traditional=False,
                    scale=1.0), "one per row"),
    (lambda: K.silu_mul(random((2, 5)), random((2, 6))), "gate and up of one shape"),
    (lambda: K.fused_products(random((2, 5)), [random((3, 5)), random((3, 6))]), "weights \\(n, k\\) of one dtype"),
    (lambda: K.fused_products(random((2, 5)), [random((3, 5))], gated=True), "two of them when gated"),
    (lambda: K.fused_products(random((2, 3, 8)), [random((8, 8))], heads=[2]), "heads needs x \\(B, 1, k\\)"),
    (lambda: K.fused_products(random((2, 1, 8)), [random((8, 8)), random((4, 8))], heads=[2, 1], offset=mx.array(0),
                              freqs=rope_periods(6, 1e4), rope_dims=6), "rope needs heads"),
    (lambda: K.fused_products(random((1, 64)), [*quantized(8, 64, 32, 4)], group_size=32, bits=3), "bits must be 4 or 8"),
    (lambda: K.attention(random((2, 4, 1, 8)), random((2, 2, 5, 8)), random((2, 2, 5, 8)), scale=1.0,
                         mask=mx.ones((2, 1, 1, 5))), "mask must be boolean"),
    (lambda: K.attention(random((2, 4, 6, 8)), random((2, 2, 5, 8)), random((2, 2, 5, 8)), scale=1.0, causal=True),
     "no more queries than positions"),
    (lambda: K.attention(random((2, 4, 8)), random((2, 2, 5, 8)), random((2, 2, 5, 8)), scale=1.0), "attention needs queries"),
])
def test_bad_arguments_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- every instruction set -----------------------------------------------------------------

ISA_CHECK = """
import json, mlx_tfm, mlx.core as mx, numpy as np
from mlx_tfm.cpu.kernels import _kernels as K
mx.random.seed(3)
x = mx.random.normal((11, 320))  # a chunk of 8 positions and one of 3
errors = {}
for bits in (4, 8):
    w, s, b = mx.quantize(mx.random.normal((77, 320)), group_size=64, bits=bits)
    ref = x @ mx.dequantize(w, s, b, group_size=64, bits=bits).T
    errors[f"q{bits}"] = float(mx.abs(K.quantized_matvec(x, w, s, b, group_size=64, bits=bits) - ref).max())
for name, dtype in (("f32", mx.float32), ("f16", mx.float16), ("bf16", mx.bfloat16)):
    w = mx.random.normal((77, 317)).astype(dtype)
    ref = x[:, :317] @ w.astype(mx.float32).T
    errors[name] = float(mx.abs(K.matvec(x[:, :317], w) - ref).max())
q, k, v = mx.random.normal((1, 6, 1, 70)), mx.random.normal((1, 2, 40, 70)), mx.random.normal((1, 2, 40, 70))
ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1)
errors["attention"] = float(mx.abs(K.attention(q, k, v, scale=0.1) - ref).max())
# a head size of whole vectors: positions scored a tile of LANES at a time, a row mask
q64, k64, v64 = mx.random.normal((2, 6, 1, 64)), mx.random.normal((2, 2, 45, 64)), mx.random.normal((2, 2, 45, 64))
mask = mx.arange(45)[None, None, None, :] >= mx.array([0, 9])[:, None, None, None]
ref = mx.fast.scaled_dot_product_attention(q64, k64, v64, scale=0.1, mask=mask)
errors["tiled attention"] = float(mx.abs(K.attention(q64, k64, v64, scale=0.1, mask=mask) - ref).max())
q = mx.random.normal((1, 6, 37, 70))
ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mx.arange(40)[None] <= mx.arange(3, 40)[:, None])
errors["causal attention"] = float(mx.abs(K.attention(q, k, v, scale=0.1, causal=True) - ref).max())
g, u = mx.random.normal((5, 333)) * 4, mx.random.normal((5, 333))
errors["silu_mul"] = float(mx.abs(K.silu_mul(g, u) - g * mx.sigmoid(g) * u).max())
w = mx.random.normal((333,))
errors["rms_norm"] = float(mx.abs(K.rms_norm(g, w, eps=1e-5) - mx.fast.rms_norm(g, w, 1e-5)).max())
errors["logsumexp"] = float(mx.abs(K.logsumexp(g) - mx.logsumexp(g, axis=-1, keepdims=True)).max())
print(json.dumps({"isa": K.isa(), "errors": errors}))
"""


# What each instruction set needs of the CPU, read from /proc/cpuinfo (the kernels are built
# on Linux only), apart from the extension's own detection; best first.
ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma", "f16c"},
             "generic": set()}
ISA_LACKS = {"avx512": "AVX-512 F/BW/VL/DQ", "avx2": "AVX2/FMA/F16C"}


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return {flag for line in f if line.startswith(("flags", "Features")) for flag in line.split(":", 1)[1].split()}


CPU_RUNS = [isa for isa, needs in ISA_NEEDS.items() if needs <= cpu_flags()]


@pytest.mark.parametrize("cap", ["", *CPU_RUNS])
def test_every_instruction_set_gives_mlx_s_numbers(cap):
    env = {**os.environ, "MLX_TFM_KERNELS_ISA": cap, "MLX_TFM_KERNELS_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", ISA_CHECK], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["isa"] == (cap or CPU_RUNS[0])  # the set asked for, or the best, never another
    assert all(error < 1e-3 for error in report["errors"].values()), report


def mlx_tfm_with_isa(isa: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLX_TFM_KERNELS": "1", "MLX_TFM_KERNELS_ISA": isa}
    return subprocess.run([sys.executable, "-m", "mlx_tfm", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("isa", ISA_NEEDS)
def test_info_runs_the_set_asked_for_or_says_the_cpu_lacks_it(isa):
    """avx512 once gave AVX2 without a word; now it gives AVX-512 or fails in one line."""
    done = mlx_tfm_with_isa(isa, "info")
    if isa in CPU_RUNS:
        assert done.returncode == 0, done.stderr
        assert f"cpu kernels     in use ({isa}, " in done.stdout
    else:
        assert done.returncode == 1
        runs = ", ".join(CPU_RUNS)
        assert done.stderr == f"error: MLX_TFM_KERNELS_ISA={isa}: this CPU lacks {ISA_LACKS[isa]} (it runs {runs})\n"


UNKNOWN_ISA = ("error: MLX_TFM_KERNELS_ISA={} is not an instruction set mlx_tfm's kernels know: use avx512, avx2 "
               "or generic, or leave it unset for the best this CPU runs\n")


@pytest.mark.parametrize("command", [["info"], ["generate", "--model", "{stories}", "-p", "hi", "-m", "2"]])
@pytest.mark.parametrize("isa", ["avx3", "AVX2", "neon"])
def test_an_unknown_instruction_set_is_one_line(isa, command, stories_hf):
    done = mlx_tfm_with_isa(isa, *(arg.format(stories=stories_hf) for arg in command))
    assert done.returncode == 1
    assert done.stderr == UNKNOWN_ISA.format(isa)
    assert "Traceback" not in done.stdout


def test_the_extension_refuses_ops_under_a_bad_request():
    """Used directly, the extension raises as an op is made (never a fallback when it runs)."""
    code = "import mlx_tfm, mlx.core as mx; from mlx_tfm.cpu.kernels import _kernels as K; K.matvec(mx.ones((1, 4)), mx.ones((2, 4)))"
    env = {**os.environ, "MLX_TFM_KERNELS_ISA": "avx3"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "ValueError: " + UNKNOWN_ISA.format("avx3")[len("error: "):].strip()


# -- the switch and what `mlx-tfm info` says -----------------------------------------------


def status_in_subprocess(env: dict) -> str:
    code = "import mlx_tfm.cpu.kernels as k; print(k.status()); print(k.kernels() is not None)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=True)
    return done.stdout


def test_the_switch_turns_the_kernels_off():
    assert status_in_subprocess({"MLX_TFM_KERNELS": "0"}) == "off (MLX_TFM_KERNELS=0): pure MLX routes\nFalse\n"
    assert status_in_subprocess({"MLX_TFM_KERNELS": "1"}).startswith(f"in use ({K.isa()}, ")


def test_kernels_built_for_another_mlx_are_not_used(monkeypatch):
    monkeypatch.setenv("MLX_TFM_KERNELS", "1")  # CI also runs these tests with the kernels off
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    kernels_package._load.cache_clear()
    try:
        assert kernels_package.kernels() is None
        assert f"built against mlx {K.built_with_mlx}, mlx 0.0.1 is installed" in kernels_package.status()
    finally:
        monkeypatch.undo()
        kernels_package._load.cache_clear()


def test_kernels_built_from_older_sources_are_not_used(monkeypatch):
    """A library from before the ISA switch's checks lacks what this module calls."""
    monkeypatch.setenv("MLX_TFM_KERNELS", "1")
    monkeypatch.setattr(K, "interface", 1)
    kernels_package._load.cache_clear()
    try:
        assert kernels_package.kernels() is None
        assert kernels_package.status() == ("not in use: built from older sources: pure MLX routes; "
                                            "`pip install -e .` rebuilds them")
    finally:
        monkeypatch.undo()
        kernels_package._load.cache_clear()


def test_kernels_not_built_are_not_used_and_info_says_so(monkeypatch):
    monkeypatch.setenv("MLX_TFM_KERNELS", "1")
    real_find_spec = kernels_package.importlib.util.find_spec
    monkeypatch.setattr(kernels_package.importlib.util, "find_spec",
                        lambda name, *args: None if name.endswith("._kernels") else real_find_spec(name, *args))
    kernels_package._load.cache_clear()
    try:
        assert kernels_package.kernels() is None
        assert kernels_package.status().startswith("not built: pure MLX routes; `pip install -e .`")
    finally:
        monkeypatch.undo()
        kernels_package._load.cache_clear()


def test_on_macos_info_says_the_kernels_are_not_built_there(monkeypatch):
    """setup.py builds them on Linux only: on macOS the message says why, not how to build."""
    monkeypatch.setenv("MLX_TFM_KERNELS", "1")
    real_find_spec = kernels_package.importlib.util.find_spec
    monkeypatch.setattr(kernels_package.importlib.util, "find_spec",
                        lambda name, *args: None if name.endswith("._kernels") else real_find_spec(name, *args))
    monkeypatch.setattr(kernels_package.sys, "platform", "darwin")
    kernels_package._load.cache_clear()
    try:
        assert kernels_package.kernels() is None
        assert kernels_package.status() == "not built on macOS (MLX runs on Metal there): pure MLX routes on its CPU"
    finally:
        monkeypatch.undo()
        kernels_package._load.cache_clear()


def test_info_names_the_kernels_in_use():
    done = subprocess.run([sys.executable, "-m", "mlx_tfm", "info"], capture_output=True, text=True, check=True,
                          env={**os.environ, "MLX_TFM_KERNELS": "1"})
    assert f"cpu kernels     in use ({K.isa()}," in done.stdout


# -- the layers route decoding through the kernels -----------------------------------------


def test_decoding_products_and_prompt_chunks_take_the_kernels(monkeypatch):
    import mlx.nn as nn

    from mlx_tfm.cpu import linear
    from mlx_tfm.cpu.linear import Embedding, Linear, QuantizedEmbedding, QuantizedLinear

    calls = []

    class Counting:  # the kernels module, counting calls
        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append(name) or getattr(K, name)(*args, **kwargs)

    monkeypatch.setattr(linear, "kernels", lambda: Counting())
    quantized = QuantizedLinear.from_linear(nn.Linear(128, 96), group_size=64, bits=4)
    half = Linear.from_linear(nn.Linear(128, 96))
    half.set_dtype(mx.float16)
    dense = Linear.from_linear(nn.Linear(128, 96))
    embedding = QuantizedEmbedding.from_embedding(nn.Embedding(500, 128), group_size=32, bits=8)
    tied = Embedding.from_embedding(nn.Embedding(2000, 64))
    for layer, x in ((quantized, random((1, 1, 128))), (half, random((1, 1, 128), mx.float16)),
                     (dense, random((1, 1, 128))), (embedding.as_linear, random((1, 1, 128))),
                     (tied.as_linear, random((1, 1, 64)))):
        mx.eval(layer(x))
    mx.eval(embedding(mx.array([[3, 7]])))
    assert calls == ["quantized_matvec", "matvec", "matvec", "quantized_matvec", "matvec", "quantized_rows"]
    mx.eval(quantized(random((1, 40, 128))), half(random((1, 40, 128), mx.float16)))
    # 40 positions: a quantized layer stays on its kernel; a 16-bit one takes the dense route
    assert calls[6:] == ["quantized_matvec", "blas_found", "matvec"]
    mx.eval(quantized(random((1, 100, 128))), half(random((1, 100, 128), mx.float16)))
    # prompt chunks: float32 BLAS over blocks of the weight dequantized (made float32) by the kernel
    assert calls[9:] == ["blas_found", "quantized_matvec", "blas_found", "matvec"]


def test_a_model_decodes_the_same_with_and_without_kernels():
    from mlx_tfm.cpu import generic_routes, specialize
    from mlx_tfm.model.transformer import Model
    from mlx_tfm.model.config import ModelArgs

    import mlx.nn as nn

    args = ModelArgs.from_dict({"model_type": "llama", "hidden_size": 128, "intermediate_size": 320,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 1000, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    model = Model(args)
    nn.quantize(model, group_size=64, bits=4)
    specialize(model)
    tokens = mx.array([[5, 17, 300, 2]])

    def logits_by_step():
        cache = model.make_cache()
        model(tokens[:, :3], cache=cache)
        return model(tokens[:, 3:], cache=cache)  # one position: the decoding route

    fast = logits_by_step()
    with generic_routes():
        plain = logits_by_step()
    assert np.allclose(np.array(fast), np.array(plain), atol=1e-4, rtol=1e-4)


def test_info_says_the_kernels_are_not_used_on_a_gpu():
    from mlx_tfm.cli.info import kernels_description

    assert kernels_description(mx.Device(mx.gpu)).startswith("not used on Device(gpu, 0) (CPU only)")


LAYER_BY_LAYER_CHECK = """
import json, mlx_tfm, mlx.core as mx, mlx.nn as nn, numpy as np
from mlx_tfm.cpu import specialize
from mlx_tfm.cpu.switch import prompt_layer_by_layer
from mlx_tfm.model import Model, ModelArgs
args = ModelArgs.from_dict({"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024,
                            "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
                            "vocab_size": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
mx.random.seed(0)
model = Model(args)
nn.quantize(model, group_size=64, bits=4)
specialize(model)
mx.eval(model.parameters())
tokens = mx.random.randint(0, 512, (1, 200))
mx.eval(tokens)

def cached_bytes(cache):
    return sum(a.nbytes for c in cache for a in c.state)

def read_prompt(layer_by_layer):
    # MLX's peak over the keys and values the prompt leaves: the activations held at once
    cache = model.make_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    if layer_by_layer:
        with prompt_layer_by_layer():
            model(tokens, cache=cache)
    else:
        model(tokens, cache=cache)
    mx.eval([c.state for c in cache])
    return mx.get_peak_memory() - before - cached_bytes(cache), [np.array(a) for c in cache for a in c.state]

def one_layer_graph():
    # the same for the first layer alone, its graph evaluated at once
    h = model.model.embed_tokens(tokens)
    mx.eval(h)
    cache = model.make_cache()[:1]
    mask = model.model._stack_masks(None, tokens.shape[1], cache, h.dtype)[0]
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model.model.layers[0](h, mask, cache[0]))
    return mx.get_peak_memory() - before - cached_bytes(cache)

read_prompt(False)  # warm-up
whole, whole_states = read_prompt(False)
by_layer, by_layer_states = read_prompt(True)
same = all(np.array_equal(a, b) for a, b in zip(whole_states, by_layer_states))
print(json.dumps({"whole": whole, "by_layer": by_layer, "one_layer": one_layer_graph(), "same": same}))
"""


def test_a_prompt_read_layer_by_layer_holds_fewer_activations_and_the_same_cache():
    """``prompt_layer_by_layer`` (generate's and the engine's prefill): with the kernels a
    layer is a few large operations, and MLX allocates the outputs of those queued ahead;
    evaluating each sublayer's output first (attention's, then the FFN's) holds fewer
    activations than one layer's whole graph does, let alone the model's, and the cache is
    bit for bit the one a single graph fills. In a process of its own with the kernels on
    (this file also runs with them off)."""
    env = {**os.environ, "MLX_TFM_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", LAYER_BY_LAYER_CHECK], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["same"], report
    assert report["by_layer"] < report["one_layer"] < report["whole"], report


POISONED_CHECK = """
import mlx_tfm, mlx.core as mx, numpy as np
from mlx_tfm.cpu.kernels import _kernels as K
from mlx_tfm.cpu.pointwise import rms_norm, soft_cap
x, weight = mx.random.normal((7, 300)), mx.random.normal((300,))
plain = mx.fast.rms_norm(x, weight, 1e-5)
print(K.outputs_poisoned(), bool(np.allclose(np.array(rms_norm(x, weight, 1e-5)), np.array(plain), atol=1e-5)),
      bool(mx.all(mx.isfinite(soft_cap(x * 1, 2.0))).item()))
"""


def test_poisoned_outputs_start_as_nan_and_the_kernels_write_all_of_them():
    """MLX_TFM_KERNELS_POISON=1 (CI runs the kernels' and generation's tests so): every
    output a kernel allocates starts as NaN, so one left partly unwritten fails every time."""
    env = {**os.environ, "MLX_TFM_KERNELS": "1", "MLX_TFM_KERNELS_POISON": "1"}
    done = subprocess.run([sys.executable, "-c", POISONED_CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True", "True"], done.stderr[-2000:]
