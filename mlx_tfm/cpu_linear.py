"""Linear layers that stay fast on MLX's CPU backend.

MLX's CPU matrix products are fast in float32 (BLAS) and slow elsewhere: its
``quantized_matmul`` suits one position at a time with float32 scales, and float16 /
bfloat16 matmuls have no BLAS at all. For a chunk of positions (a prompt, a training
batch), or with half-precision scales (as most quantized checkpoints on the hub have),
turning the weight into float32 just before the product is far faster. Measured here for
a 576x1536 layer:

| weight, positions | as stored | float32 just in time |
|---|---|---|
| 4-bit, float32 scales, 180 | 200 ms | 7 ms |
| 4-bit, float16 scales, 180 | 5.5 s | 4 ms |
| 4-bit, float16 scales, 1 | 27 ms | 1.7 ms |
| 4-bit, float32 scales, 1 | 1.2 ms | 2.6 ms (decoding keeps the quantized kernel) |
| float16, 180 | 282 ms | 12.5 ms |
| float16, 1 | 1.8 ms | 1.7 ms (decoding keeps the float16 product) |

and for float32 weights and one position (decoding), ``W @ x`` instead of ``x @ W.T``:
0.07 ms against 0.25 ms for 576 -> 1536 (OpenBLAS's skinny products differ by layout).

The layers here pick the faster route per call on the CPU and are the plain MLX layers
elsewhere (Metal). Weights stay as stored in memory: a float32 copy of an eighth of one
layer's weight exists only while it is used.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path


def float32_product(x: mx.array, float32_rows: Callable[[int, int, mx.array], mx.array], out_dims: int,
                    blocks: int = 8) -> mx.array:
    """``x @ W.T`` in float32, with W made float32 by ``float32_rows(start, stop, after)``
    a block of rows at a time, each conversion starting only after ``after`` (the previous
    block's product) is computed: else MLX would convert the weights of many layers ahead,
    since they depend on nothing else, and hold them all. So about one block's float32
    copy exists at a time."""
    x32 = x.astype(mx.float32)
    ready = x32
    outputs = []
    step = -(-out_dims // blocks)
    for start in range(0, out_dims, step):
        weight = float32_rows(start, min(start + step, out_dims), ready)  # (rows, in)
        ready = x32 @ weight.T
        outputs.append(ready.astype(x.dtype))
    return mx.concatenate(outputs, axis=-1)


def decode_product(x: mx.array, weight: mx.array, block_elements: int = 1 << 15) -> mx.array:
    """``x @ W.T`` for one position and a half-precision W, as float32 ``W @ x`` (BLAS)
    on a float32 copy of a block of W's rows (``block_elements`` weights, 128 KiB) at a
    time, each copy made only after the previous block's product (as in
    ``float32_product``). MLX's CPU half-precision product has no BLAS: for the 135M
    model's 49152-row tied head it took ~110 ms against ~40-55 ms this way, and ~1.4 ms
    against ~1.0 ms for a 576 -> 1536 layer; a whole float16 decoding step ~375 ms against
    ~190-215 ms. The blocks are small because MLX allocates outputs ahead of the CPU
    thread computing them, so several blocks are alive at once: with 256-row blocks a
    decoding step peaked 11 MB above the stored model, with 32K-weight blocks 3 MB
    (below a prompt chunk's peak), for ~10% of the gain."""
    out_dims, in_dims = weight.shape
    block_rows = max(1, block_elements // in_dims)
    x32 = x.reshape(-1, 1).astype(mx.float32)  # (in, 1)
    ready = x32
    outputs = []
    for start in range(0, out_dims, block_rows):
        rows = mx.depends(weight[start:start + block_rows], ready).astype(mx.float32)  # (rows, in)
        ready = rows @ x32  # (rows, 1)
        outputs.append(ready)
    # (out, 1) -> (..., out)
    return mx.concatenate(outputs, axis=0).astype(x.dtype).reshape(*x.shape[:-1], out_dims)


def is_half(weight: mx.array) -> bool:
    return weight.dtype in (mx.float16, mx.bfloat16)


class QuantizedLinear(nn.QuantizedLinear):
    # From this many positions on, the dense route wins even with float32 scales.
    dense_from_rows = 16

    def __call__(self, x: mx.array) -> mx.array:
        if not self.dense_is_faster(x):
            return super().__call__(x)
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
        if mx.default_device() != mx.cpu or self.mode != "affine":
            return False
        rows = x.size // x.shape[-1]
        return rows >= self.dense_from_rows or self["scales"].dtype != mx.float32


class Linear(nn.Linear):
    """``nn.Linear`` choosing the faster product on the CPU:

    - float16/bfloat16 weights over many positions (a prompt chunk): in float32, by blocks;
    - float32 weights for one position (decoding): ``W @ x`` rather than ``x @ W.T``, which
      OpenBLAS runs up to 3.5x slower for expanding shapes (576 -> 1536: 0.25 ms against
      0.07 ms), except for very wide outputs such as a vocabulary head.
    """

    dense_from_rows = 16

    def __call__(self, x: mx.array) -> mx.array:
        if mx.default_device() != mx.cpu:
            return super().__call__(x)
        rows = x.size // x.shape[-1]
        weight = self["weight"]
        if is_half(weight) and rows >= self.dense_from_rows:
            y = float32_product(x, self.float32_rows, weight.shape[0])
        elif is_half(weight) and rows == 1:
            y = decode_product(x, weight)
        elif weight.dtype == mx.float32 and rows == 1 and weight.shape[0] <= 8 * weight.shape[1]:
            y = (weight @ x.reshape(-1, 1)).reshape(*x.shape[:-1], weight.shape[0])  # (out, 1) -> (..., out)
        else:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def float32_rows(self, start: int, stop: int, after: mx.array) -> mx.array:
        return mx.depends(self["weight"][start:stop], after).astype(mx.float32)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Linear":
        output_dims, input_dims = linear.weight.shape
        layer = cls(input_dims, output_dims, bias="bias" in linear)
        layer.update(linear.parameters())
        return layer


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied output head) decodes one position of
    half-precision weights through ``decode_product`` on the CPU (~2x faster for the
    135M model's 49152-row head, the largest product of a decoding step)."""

    def as_linear(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if mx.default_device() == mx.cpu and is_half(weight) and x.size == x.shape[-1]:
            return decode_product(x, weight)
        return super().as_linear(x)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> "Embedding":
        layer = cls(*embedding.weight.shape)
        layer.update(embedding.parameters())
        return layer


def use_cpu_linears(model: nn.Module) -> None:
    """Swap ``Linear`` and ``Embedding`` in for the model's plain linear and embedding layers."""

    def swap(path: str, module: nn.Module) -> nn.Module:
        if type(module) is nn.Linear:
            return Linear.from_linear(module)
        if type(module) is nn.Embedding:
            return Embedding.from_embedding(module)
        return module

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))


def quantize_model(model: nn.Module, group_size: int, bits: int, class_predicate: Callable[[str, nn.Module], bool]) -> None:
    """``nn.quantize``, with ``QuantizedLinear`` for the linear layers."""

    def quantize(path: str, module: nn.Module) -> nn.Module:
        if not class_predicate(path, module):
            return module
        if isinstance(module, nn.Linear):
            return QuantizedLinear.from_linear(module, group_size, bits)
        return module.to_quantized(group_size=group_size, bits=bits)

    model.update_modules(tree_map_with_path(quantize, model.leaf_modules(), is_leaf=nn.Module.is_module))
