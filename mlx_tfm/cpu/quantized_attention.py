"""Attention over a quantized KV cache on the CPU: in float32, the scores on every core.

MLX's CPU ``quantized_matmul`` runs on one core and is several times slower with
half-precision queries and scales than with float32 ones (figures in docs/generate.md, "Faster
and longer generation"). So on the CPU:

- ``in_float32``: the queries and the cache's scales and biases (one of each per group of
  numbers: 1/32 of the cache at 4 bits, group 64) become float32 just in time; the packed
  keys and values are read as they are, never dequantized;
- ``scores``: for a few queries per KV head (decoding, a speculative check) the queries
  times the packed keys go through mlx_tfm's ``quantized_matvec`` kernel, the keys as its
  "weight rows", split over every core. The weighted sum of the values (a sum over
  positions, which the kernel does not do) stays MLX's product: split over the CPU streams
  it was no faster.
"""

from __future__ import annotations

import mlx.core as mx

from .kernels import kernels
from .linear import DENSE_FROM_ROWS


def in_float32(queries: mx.array, keys, values):
    """``queries`` and the ``QuantizedKV`` keys/values with float32 scales and biases."""
    keys, values = (x._replace(scales=x.scales.astype(mx.float32), biases=x.biases.astype(mx.float32))
                    for x in (keys, values))
    return queries.astype(mx.float32), keys, values


def kernel_takes(queries: mx.array, keys) -> bool:
    """Whether ``scores`` takes these queries (B, n_heads, L, head_dim): mlx_tfm's kernels
    are in use and each KV head has fewer than ``DENSE_FROM_ROWS`` queries."""
    n_rep = queries.shape[1] // keys.data.shape[1]
    return kernels() is not None and n_rep * queries.shape[2] < DENSE_FROM_ROWS


def scores(queries: mx.array, keys) -> mx.array:
    """Grouped queries (B, n_kv_heads, n_rep, L, head_dim) times the ``QuantizedKV`` keys
    (B, n_kv_heads, S, packed) -> (B, n_kv_heads, n_rep, L, S), one kernel call per batch
    row and KV head."""
    B, n_kv_heads, n_rep, L, head_dim = queries.shape
    rows = [
        kernels().quantized_matvec(queries[b, h].reshape(n_rep * L, head_dim), keys.data[b, h], keys.scales[b, h],
                                   keys.biases[b, h], group_size=keys.group_size, bits=keys.bits)  # (n_rep * L, S)
        for b in range(B) for h in range(n_kv_heads)
    ]
    return mx.stack(rows).reshape(B, n_kv_heads, n_rep, L, -1)
