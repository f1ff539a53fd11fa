"""The chunked gated delta rule (Gated DeltaNet's prompt form) as one mlx_tfm kernel call on
MLX's CPU backend: heads over the kernels' threads, each head's chunks in order, computed in
float32 (kernels/src/deltanet_body.inc).

On the CPU the plain form (model/deltanet.py) is a few dozen small MLX ops per chunk, each a
pass over (heads, chunk, 128) arrays with its own dispatch; the kernel keeps a chunk's
products, its triangular solve and the state's update in one loop per head. Gradients are
the plain route's (its ``mx.vjp``), which the caller hands in: this package does not import
the model. ``takes`` says when the kernel runs; elsewhere (Metal, CUDA, kernels off, Kimi's
per-channel decay) the plain route does.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from .kernels import kernels
from .switch import on_cpu


def takes(g: mx.array) -> bool:
    """Whether the kernel runs: on the CPU with the kernels, one decay per head and position
    (g (B, H, L)), not Kimi's decay per key channel (B, H, L, Dk)."""
    return on_cpu() and kernels() is not None and g.ndim == 3


def delta_rule_chunked(plain: Callable, queries, keys, values, g, beta, state, chunk_size: int):
    """``plain(queries, keys, values, g, beta, state, chunk_size)`` -> (out (B, H, L, Dv),
    state (B, H, Dk, Dv)) through the kernel, with ``plain``'s gradients."""

    @mx.custom_function
    def kernel(q, k, v, decay, b, s):
        out, final = kernels().delta_rule_chunked(q, k, v, decay, b, s, chunk_size=chunk_size)
        return out, final

    @kernel.vjp
    def kernel_vjp(primals, cotangents, outputs):
        _, grads = mx.vjp(lambda *a: plain(*a, chunk_size), list(primals), list(cotangents))
        return tuple(grads)

    return kernel(queries, keys, values, g, beta, state)
