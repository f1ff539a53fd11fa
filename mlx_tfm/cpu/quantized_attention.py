"""Attention over a quantized KV cache on the CPU: in float32.

MLX's CPU ``quantized_matmul`` is 5-40x slower with half-precision queries and scales than
with float32 ones (measured on the 135M model's heads over 4,096 cached positions:
bfloat16 ~5x, float16 ~40x). So on the CPU the queries and the cache's scales and biases
(one of each per group of 64 numbers: 1/32 of the cache at 4 bits) become float32 just in
time; the packed keys and values are read as they are, never dequantized.
"""

from __future__ import annotations

import mlx.core as mx


def in_float32(queries: mx.array, keys, values):
    """``queries`` and the ``QuantizedKV`` keys/values with float32 scales and biases."""
    keys, values = (x._replace(scales=x.scales.astype(mx.float32), biases=x.biases.astype(mx.float32))
                    for x in (keys, values))
    return queries.astype(mx.float32), keys, values
