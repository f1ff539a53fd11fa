"""A layer's pointwise ops on MLX's CPU backend, one mlx_tfm kernel call each: RMSNorm,
RoPE, SwiGLU's ``silu(gate) * up``, Gemma's soft cap on logits, and the log-sum-exp that
turns logits into log-probabilities.

On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` are fallbacks: chains of primitive
ops (a RoPE call computes its angles with eight of them), and MLX's exp and tanh are scalar loops on one thread,
so a decoding step of a small model spends as much time here as in its products (numbers
in docs/cpu-kernels.md). The kernels compute the same in float32 with the CPU's SIMD;
their gradients are MLX's own ops'. ``None`` from ``kernels()`` (switched off, not built)
means the callers run the plain MLX ops, as on Metal and CUDA.
"""

from __future__ import annotations

import mlx.core as mx

from .kernels import kernels
from .switch import on_cpu


def in_use() -> bool:
    """Whether the pointwise ops go through the kernels now."""
    return on_cpu() and kernels() is not None


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)``."""
    return kernels().rms_norm(x, weight, eps=eps)


def rope(x: mx.array, offset: int | mx.array, freqs: mx.array, dims: int, traditional: bool,
         scale: float) -> mx.array:
    """``mx.fast.rope(x, dims, ..., base=None, offset=offset, freqs=freqs)`` for x (B, H, L, D);
    ``offset`` one position or one per row (B,)."""
    return kernels().rope(x, mx.array(offset), freqs, dims=dims, traditional=traditional, scale=scale)


def logsumexp(x: mx.array) -> mx.array:
    """``mx.logsumexp(x, axis=-1, keepdims=True)``."""
    return kernels().logsumexp(x)


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up``."""
    return kernels().silu_mul(gate, up)


def soft_cap(x: mx.array, cap: float) -> mx.array:
    """``mx.tanh(x / cap) * cap``."""
    return kernels().soft_cap(x, cap=cap)
