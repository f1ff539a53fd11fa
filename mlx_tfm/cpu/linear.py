"""Linear layers that stay fast on MLX's CPU backend.

MLX's CPU matrix products are fast in float32 (BLAS, on every core) and slow elsewhere:
its ``quantized_matmul`` runs on one core and only with float32 scales, and float16 /
bfloat16 products have no BLAS and run on one core too. So on the CPU:

- a chunk of positions (a prompt, a training batch) multiplies in float32, the weight
  made float32 just in time a block of rows at a time (``float32_product``; inside one
  kernel call into one reused buffer where mlx_tfm's kernels are in use:
  ``dense_half_product`` for float16 / bfloat16 weights, ``dense_quantized_product`` for
  the quantized layers they take);
- a few positions (decoding) keep the stored weight but split its rows over one CPU
  stream per core (``rows_in_parallel``): MLX runs each stream on a thread of its own.
  Quantized scales become float32 just in time.

Measured here (2 cores) for one 576x1536 layer:

| weight, positions | plain MLX | here |
|---|---|---|
| 4-bit, float32 scales, 180 | 200 ms | 7 ms (float32 just in time) |
| 4-bit, float16 scales, 180 | 5.5 s | 4 ms (float32 just in time) |
| 4-bit, float32 scales, 1 | 0.8 ms | ~0.5 ms (2 streams) |
| 4-bit, float16 scales, 1 | 27 ms | ~0.5 ms (float32 scales, 2 streams) |
| float16, 180 | 282 ms | 12.5 ms (float32 just in time) |
| float16, 1 | 1.5-2.8 ms | 0.9 ms (2 streams) |

and for float32 weights and one position, ``W @ x`` instead of ``x @ W.T``: 0.07 ms
against 0.25 ms for 576 -> 1536 (OpenBLAS's skinny products differ by layout).

The layers pick their route per call while ``mlx_tfm.cpu.on_cpu()`` holds and are the plain
MLX layers otherwise (Metal, CUDA, or the switch off). Weights stay as stored in memory: float32 copies of 256 KiB blocks exist only
while a chunk uses them; decoding copies nothing.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .kernels import kernels
from .switch import int8_activations, on_cpu

# float32 bytes of a block of rows made float32 at a time (float32_product)
FLOAT32_BLOCK_BYTES = 1 << 18


def float32_product(x: mx.array, float32_rows: Callable[[int, int, mx.array], mx.array], out_dims: int) -> mx.array:
    """``x @ W.T`` in float32, with W made float32 by ``float32_rows(start, stop, after)``
    a block of rows (about ``FLOAT32_BLOCK_BYTES`` of float32) at a time, each conversion starting
    only after ``after`` (the previous block's product) is computed: else MLX would convert
    the weights of many layers ahead, since they depend on nothing else, and hold them all.
    A few blocks are still alive at once (MLX allocates the outputs of the tasks queued
    ahead of the one computing); so blocks are small: for the 135M float16 model a 31-token
    prompt peaked 6.5 MB above its weights and cache with eighths of each layer, 2.6 MB with
    256 KiB, for ~10% more time."""
    x32 = x.astype(mx.float32)
    ready = x32
    outputs = []
    step = max(1, FLOAT32_BLOCK_BYTES // (4 * x.shape[-1]))
    for start in range(0, out_dims, step):
        weight = float32_rows(start, min(start + step, out_dims), ready)  # (rows, in)
        ready = x32 @ weight.T
        outputs.append(ready.astype(x.dtype))
    return mx.concatenate(outputs, axis=-1)


# From this many positions on, a product goes through float32 BLAS (``float32_product``).
DENSE_FROM_ROWS = 16
# The same for a quantized layer mlx_tfm's kernels take: they read each weight once for 8
# positions, and the dense route must first dequantize the whole layer, so the kernels win
# for longer (a batch of 16-64 decoding streams; crossover measured in docs/cpu-kernels.md).
QUANTIZED_DENSE_FROM_ROWS = 96


# MLX's streams belong to the thread that made them (and die with its default stream when
# the thread frees its streams: engine/threads.py), so each thread keeps its own extras.
_this_thread = threading.local()


def extra_cpu_streams() -> tuple[mx.Stream, ...]:
    """One CPU stream per core beyond the first (at most 3), this thread's: MLX runs each
    CPU stream's work on a thread of its own, while one quantized product keeps to one thread."""
    default = mx.default_stream(mx.cpu)
    known = getattr(_this_thread, "default", None)
    if known is None or known != default:
        _this_thread.default, _this_thread.extra = default, tuple(
            mx.new_stream(mx.cpu) for _ in range(min(usable_cores(), 4) - 1))
    return _this_thread.extra


@functools.cache
def usable_cores() -> int:
    """On Linux the cores this process may use, which a container can restrict."""
    return len(os.sched_getaffinity(0)) if sys.platform == "linux" else os.cpu_count() or 1


def rows_in_parallel(product_of_rows: Callable[[int, int], mx.array], out_dims: int) -> mx.array:
    """A layer's outputs computed a slice at a time on every CPU stream at once, then
    joined: ``product_of_rows(start, stop)`` gives outputs ``start:stop`` (..., stop - start).
    MLX's CPU quantized and half-precision products run on one core: on two cores a
    decoding step of the 135M model took ~95 ms this way against ~131 ms in 4-bit."""
    streams = (mx.default_stream(mx.cpu), *extra_cpu_streams())
    step = -(-out_dims // len(streams))
    parts = []
    for stream, start in zip(streams, range(0, out_dims, step)):
        with mx.stream(stream):
            parts.append(product_of_rows(start, min(start + step, out_dims)))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def kernels_take(layer: nn.Module) -> bool:
    """Whether mlx_tfm's C++ kernels (``mlx_tfm.cpu.kernels``) are in use and cover this
    affine quantized layer's layout (4 or 8 bits, group 32, 64 or 128, with biases)."""
    return (kernels() is not None and layer.bits in (4, 8) and layer.group_size in (32, 64, 128)
            and "biases" in layer)


def quantized_rows_product(x: mx.array, layer: nn.Module) -> mx.array:
    """``x @ W.T`` for a quantized ``layer`` (weight, scales, biases): one call of mlx_tfm's
    kernels where they take it (with int8 activations where ``int8_activations()`` is on),
    else MLX's kernel with its rows split over the CPU streams.
    MLX's kernel is fast only with float32 scales and
    inputs (27 ms against 0.8 ms for one position through a 576 -> 1536 layer with float16
    scales), so half-precision scales and inputs become float32 just in time: for each
    slice that is a 32nd of its weights' count (group size 64), a few microseconds."""
    weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if kernels_take(layer):
        return kernels().quantized_matvec(x, weight, scales, biases, group_size=layer.group_size,
                                          bits=layer.bits, int8_activations=int8_activations()).astype(x.dtype)
    x32 = x.astype(mx.float32)

    def product_of_rows(start: int, stop: int) -> mx.array:
        return mx.quantized_matmul(
            x32, weight[start:stop], scales[start:stop].astype(mx.float32),
            None if biases is None else biases[start:stop].astype(mx.float32),
            transpose=True, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
        )

    return rows_in_parallel(product_of_rows, weight.shape[0]).astype(x.dtype)


def dense_quantized_product(x: mx.array, layer: nn.Module) -> mx.array:
    """``x @ W.T`` for a chunk of positions and a quantized ``layer`` mlx_tfm's kernels take:
    one kernel call, float32 BLAS over blocks of the weight dequantized into one reused
    buffer (no float32 copy of the layer ever exists)."""
    return kernels().quantized_matvec(x, layer["weight"], layer["scales"], layer["biases"],
                                      group_size=layer.group_size, bits=layer.bits, dense=True).astype(x.dtype)


def is_half(weight: mx.array) -> bool:
    return weight.dtype in (mx.float16, mx.bfloat16)


def split_product(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ W.T`` as stored: mlx_tfm's kernel where it is in use, else W's rows split over
    the CPU streams."""
    if kernels() is not None:
        return kernels().matvec(x, weight)
    return rows_in_parallel(lambda start, stop: x @ weight[start:stop].T, weight.shape[0])


def dense_half_product(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ W.T`` for a chunk of positions and a float16 / bfloat16 W, in one call of
    mlx_tfm's kernels: x made float32 once, W's rows made float32 a block at a time (F16C,
    or a shift for bfloat16) into one reused buffer and multiplied by float32 BLAS, each
    block's outputs rounded into place. No float32 copy of W exists, and the graph holds
    one operation where ``float32_product`` holds three per block."""
    return kernels().matvec(x, weight, dense=True).astype(x.dtype)


def half_product(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ W.T`` for a float16 / bfloat16 W: in float32 by blocks for a chunk of
    positions (``dense_half_product`` where mlx_tfm's kernels and BLAS are at hand), else as
    stored with W's rows split over the CPU streams."""
    if x.size // x.shape[-1] < DENSE_FROM_ROWS:
        return split_product(x, weight)
    if kernels() is not None and kernels().blas_found():
        return dense_half_product(x, weight)

    def float32_rows(start: int, stop: int, after: mx.array) -> mx.array:
        return mx.depends(weight[start:stop], after).astype(mx.float32)

    return float32_product(x, float32_rows, weight.shape[0])


def few_rows(rows: int) -> bool:
    """Whether ``float32_decode_product`` takes ``rows`` positions: one, or fewer than
    ``DENSE_FROM_ROWS`` through mlx_tfm's kernel, which reads each weight once for up to 8
    (speculative decoding checks a few positions at once; MLX's ``x @ W.T`` is several
    times slower for so few rows: figures in docs/generate.md, "Faster and longer generation")."""
    return rows == 1 or (rows < DENSE_FROM_ROWS and kernels() is not None)


def float32_decode_product(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ W.T`` for one position and a float32 W: ``W @ x``, which OpenBLAS runs up to
    3.5x faster for expanding shapes; but for very wide outputs (a vocabulary head)
    ``x @ W.T`` with the rows split over the CPU streams (49152x576: ~9 ms against ~10 ms,
    ~11 ms as ``W @ x``). mlx_tfm's kernel, where it is in use, streams W at the memory's
    speed in every shape, for a few positions too (``few_rows``)."""
    if kernels() is not None:
        return kernels().matvec(x, weight)
    out_dims, in_dims = weight.shape
    if out_dims <= 8 * in_dims:
        return (weight @ x.reshape(-1, 1)).reshape(*x.shape[:-1], out_dims)  # (out, 1) -> (..., out)
    return split_product(x, weight)


def dequantized_head_product(x: mx.array, layer: nn.Module, transpose: bool) -> mx.array:
    """Many rows (a prompt's latents) through small per-head quantized matrices (latent
    attention's ``embed_q`` and ``unembed_out``, (H, out, in)): the matrices made float32
    whole, then BLAS. MLX's CPU ``quantized_matmul`` runs on one core, and these matrices
    are a few hundred KiB, so making them float32 at each call costs less than one product."""
    weight = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                           bits=layer.bits, mode=layer.mode).astype(mx.float32)
    out = x.astype(mx.float32) @ (weight.swapaxes(-1, -2) if transpose else weight)
    # quantized_matmul's type: x's where the scales share it, else float32 (its promotion of two float types)
    return out.astype(x.dtype) if layer["scales"].dtype == x.dtype else out


def fused_products(layers: tuple[nn.Module, ...], x: mx.array, gated: bool = False,
                   heads: tuple[int, ...] | None = None, rope: tuple | None = None) -> list[mx.array] | None:
    """``[layer(x) for layer in layers]`` in one call of mlx_tfm's kernels (one pass of the
    thread pool over all their rows, one operation instead of several in the graph), or with
    ``gated`` (two layers, gate and up) ``[silu(gate(x)) * up(x)]``. None when the layers do
    not take the kernels' route together: not all this module's float layers, or all its
    quantized layers of one layout, without biases, for few enough positions.

    ``heads`` (one position, x (B, 1, D)): each output as (B, heads, 1, head_dim), the layout
    attention reads; ``rope`` ``(offset, periods, dims, traditional, scale)`` rotates the
    first two (queries and keys) as ``mx.fast.rope`` with ``freqs=periods`` would."""
    if not on_cpu() or kernels() is None:
        return None
    layout = {} if heads is None else {"heads": list(heads)}
    if rope is not None:
        offset, periods, dims, traditional, scale = rope
        # an array offset as it is: a copy would be one more operation per layer and step
        offset = offset if isinstance(offset, mx.array) else mx.array(offset)
        layout.update(offset=offset, freqs=periods, rope_dims=dims, traditional=traditional,
                      rope_scale=scale)
    rows = x.size // x.shape[-1]
    kind = type(layers[0])
    if any(type(layer) is not kind or "bias" in layer for layer in layers):
        return None
    if kind is Linear:
        weights = [layer["weight"] for layer in layers]
        if rows >= DENSE_FROM_ROWS or any(w.dtype != weights[0].dtype for w in weights):
            return None
        return kernels().fused_products(x, weights, gated=gated, **layout)
    if kind is QuantizedLinear:
        first = layers[0]
        if rows >= QUANTIZED_DENSE_FROM_ROWS or not all(
                layer.mode == "affine" and kernels_take(layer) and layer.bits == first.bits
                and layer.group_size == first.group_size and layer["scales"].dtype == first["scales"].dtype
                for layer in layers):
            return None
        arrays = [layer[name] for layer in layers for name in ("weight", "scales", "biases")]
        outputs = kernels().fused_products(x, arrays, group_size=first.group_size, bits=first.bits, gated=gated,
                                           int8_activations=int8_activations(), **layout)
        return [y.astype(x.dtype) for y in outputs]
    return None


def same_arrays_as(cls, layer: nn.Module) -> nn.Module:
    """An instance of ``cls`` (a CPU-route subclass of ``type(layer)``) holding ``layer``'s
    arrays and settings, without quantizing or initialising anything anew."""
    twin = cls.__new__(cls)
    twin.__dict__.update(layer.__dict__)  # group_size, bits, mode, training and frozen flags
    twin._no_grad = set(layer._no_grad)
    dict.update(twin, layer)  # weight, scales, biases, bias
    return twin


class QuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` choosing the faster product on the CPU (affine mode): a chunk
    of positions in float32, by blocks; fewer positions through MLX's kernel, split over
    the CPU streams, with float32 scales."""

    dense_from_rows = DENSE_FROM_ROWS

    def __call__(self, x: mx.array) -> mx.array:
        if not on_cpu() or self.mode != "affine":
            return super().__call__(x)
        if not self.dense_is_faster(x):
            y = quantized_rows_product(x, self)
        elif kernels_take(self) and kernels().blas_found():
            y = dense_quantized_product(x, self)
        else:
            y = float32_product(x, self.float32_rows, self["weight"].shape[0])
        if "bias" in self:
            y = y + self["bias"]
        return y

    def float32_rows(self, start: int, stop: int, after: mx.array) -> mx.array:
        biases = self.get("biases")
        return mx.dequantize(
            mx.depends(self["weight"][start:stop], after), self["scales"][start:stop].astype(mx.float32),
            None if biases is None else biases[start:stop].astype(mx.float32),
            group_size=self.group_size, bits=self.bits, mode=self.mode,
        )

    def dense_is_faster(self, x: mx.array) -> bool:
        return x.size // x.shape[-1] >= self.dense_from()

    def dense_from(self) -> int:
        """From how many positions the dense route is the faster."""
        return QUANTIZED_DENSE_FROM_ROWS if kernels_take(self) else self.dense_from_rows

    @classmethod
    def from_quantized(cls, layer: nn.QuantizedLinear) -> "QuantizedLinear":
        return same_arrays_as(cls, layer)


class Linear(nn.Linear):
    """``nn.Linear`` choosing the faster product on the CPU:

    - float16/bfloat16 weights: ``half_product``;
    - float32 weights for one position (decoding): ``float32_decode_product``.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if not on_cpu():
            return super().__call__(x)
        rows = x.size // x.shape[-1]
        weight = self["weight"]
        if is_half(weight):
            y = half_product(x, weight)
        elif weight.dtype == mx.float32 and few_rows(rows):
            y = float32_decode_product(x, weight)
        else:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Linear":
        return same_arrays_as(cls, linear)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied output head) takes the faster CPU
    product: ``half_product`` for half-precision weights (the 135M model's 49152-row head,
    the largest product of a decoding step: ~34 ms against ~63 ms), and
    ``float32_decode_product`` for one position in float32."""

    def as_linear(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if not on_cpu():
            return super().as_linear(x)
        if is_half(weight):
            return half_product(x, weight)
        if weight.dtype == mx.float32 and few_rows(x.size // x.shape[-1]):
            return float32_decode_product(x, weight)
        return super().as_linear(x)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> "Embedding":
        return same_arrays_as(cls, embedding)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied output head, 49152 rows for the
    135M model) takes ``quantized_rows_product``, and whose lookup is one kernel call
    (gather and dequantize fused) where mlx_tfm's kernels take the layer."""

    def __call__(self, x: mx.array) -> mx.array:
        if not on_cpu() or self.mode != "affine" or not kernels_take(self):
            return super().__call__(x)
        return kernels().quantized_rows(x, self["weight"], self["scales"], self["biases"],
                                        group_size=self.group_size, bits=self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        if not on_cpu() or self.mode != "affine":
            return super().as_linear(x)
        return quantized_rows_product(x, self)

    @classmethod
    def from_quantized(cls, layer: nn.QuantizedEmbedding) -> "QuantizedEmbedding":
        return same_arrays_as(cls, layer)
