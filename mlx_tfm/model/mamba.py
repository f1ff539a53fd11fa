"""The Mamba-2 token mixer (layer type "mamba"), as transformers' Mamba2Mixer defines it.

    in_proj(x) -> z (gate), xBC, dt
    xBC -> causal depthwise conv1d (kernel K) -> silu -> x (H heads of P), B, C (G groups of N)
    dt  -> softplus(dt + dt_bias), clipped to the config's time-step limits
    y   =  SSD scan(x, dt, A = -exp(A_log), B, C) + D * x          (model/ssd.py)
    y   -> gated RMSNorm with z (over each of the G groups) -> out_proj

Its cache is a ``StateCache(2)``: ``[conv_state (B, K - 1, conv_dim), ssm_state (B, H, P, N)]``,
the conv's last K - 1 inputs and the scan's state. Parameter names follow the checkpoints
(``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``); ``conv1d.weight``
is stored (conv_dim, K, 1), MLX's convolution layout, as mlx-lm stores it.

Shapes: B batch, L positions, D hidden size, I = H * P the inner width.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .ssd import ssd_scan
from .state_cache import StateCache


class CausalConv1d(nn.Module):
    """A depthwise convolution over positions that sees only the past: channel c's output
    at t is bias_c + sum_k weight[c, k] * input[t - K + 1 + k, c]."""

    def __init__(self, channels: int, kernel_size: int, bias: bool):
        super().__init__()
        self.weight = mx.zeros((channels, kernel_size, 1))  # (C, K, 1): MLX's Conv1d layout
        if bias:
            self.bias = mx.zeros((channels,))

    def __call__(self, padded: mx.array) -> mx.array:
        """``padded`` (B, K - 1 + L, C): the K - 1 inputs before the first one, then L -> (B, L, C)."""
        K = self.weight.shape[1]
        length = padded.shape[1] - K + 1
        taps = self.weight[:, :, 0].T  # (K, C)
        out = sum(padded[:, k : k + length] * taps[k] for k in range(K))
        return out + self.bias if "bias" in self else out


class GatedRMSNorm(nn.Module):
    """RMSNorm of y gated by silu(z), each of ``n_groups`` slices of the width normed on its
    own. ``norm_before_gate``: norm y, then gate (Falcon-H1's option); else gate, then norm."""

    def __init__(self, dims: int, n_groups: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.n_groups, self.eps, self.norm_before_gate = n_groups, eps, norm_before_gate

    def _grouped_norm(self, y: mx.array) -> mx.array:
        grouped = y.reshape(*y.shape[:-1], self.n_groups, -1)  # (..., G, I / G)
        normed = grouped * mx.rsqrt(mx.mean(mx.square(grouped), axis=-1, keepdims=True) + self.eps)
        return normed.reshape(y.shape)  # (..., I)

    def __call__(self, y: mx.array, z: mx.array) -> mx.array:
        dtype = y.dtype
        y, gate = y.astype(mx.float32), nn.silu(z.astype(mx.float32))
        y = self._grouped_norm(y) * gate if self.norm_before_gate else self._grouped_norm(y * gate)
        return self.weight * y.astype(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads, self.head_dim = args.mamba_num_heads, args.mamba_head_dim
        self.n_groups, self.state_size = args.mamba_n_groups, args.mamba_state_size
        self.conv_kernel, self.chunk_size = args.mamba_conv_kernel, args.mamba_chunk_size
        self.time_step_limit = args.mamba_time_step_limit
        self.inner = self.n_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        D = args.hidden_size
        self.in_proj = nn.Linear(D, self.inner + self.conv_dim + self.n_heads, bias=args.mamba_proj_bias)
        self.conv1d = CausalConv1d(self.conv_dim, self.conv_kernel, args.mamba_conv_bias)
        self.dt_bias = mx.ones((self.n_heads,))
        self.A_log = mx.log(mx.arange(1, self.n_heads + 1, dtype=mx.float32))
        self.D = mx.ones((self.n_heads,))
        if args.mamba_gated_norm:
            self.norm = GatedRMSNorm(self.inner, self.n_groups, args.mamba_norm_eps, args.mamba_norm_before_gate)
        self.out_proj = nn.Linear(self.inner, D, bias=args.mamba_out_proj_bias)

    def make_cache(self) -> StateCache:
        """[conv_state (B, K - 1, conv_dim), ssm_state (B, H, P, N)], filled on first use."""
        return StateCache(2)

    def _convolve(self, xBC: mx.array, cache: StateCache | None) -> mx.array:
        """xBC (B, L, conv_dim) -> silu(conv) (B, L, conv_dim); keeps the last K - 1 inputs."""
        keep = self.conv_kernel - 1
        past = cache[0] if cache is not None else None
        if past is None:
            past = mx.zeros((xBC.shape[0], keep, self.conv_dim), dtype=xBC.dtype)
        padded = mx.concatenate([past, xBC], axis=1)  # (B, K - 1 + L, conv_dim)
        if cache is not None:
            cache[0] = padded[:, padded.shape[1] - keep :]
        return nn.silu(self.conv1d(padded))

    def _time_steps(self, dt: mx.array) -> mx.array:
        """Raw dt (B, L, H) -> softplus(dt + dt_bias), clipped to the time-step limits, float32."""
        dt = nn.softplus(dt.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        low, high = self.time_step_limit
        return dt if (low, high) == (0.0, float("inf")) else mx.clip(dt, low, high)

    def __call__(self, x: mx.array, mask=None, cache: StateCache | None = None) -> mx.array:
        """x (B, L, D) -> (B, L, D); ``mask`` is unused (the scan is causal by construction)."""
        batch, length, _ = x.shape
        z, xBC, dt = mx.split(self.in_proj(x), [self.inner, self.inner + self.conv_dim], axis=-1)
        xBC = self._convolve(xBC, cache)
        groups = self.n_groups * self.state_size
        hidden, B, C = mx.split(xBC, [self.inner, self.inner + groups], axis=-1)
        hidden = hidden.reshape(batch, length, self.n_heads, self.head_dim)  # (B, L, H, P)
        B = B.reshape(batch, length, self.n_groups, self.state_size)  # (B, L, G, N)
        C = C.reshape(batch, length, self.n_groups, self.state_size)
        state = cache[1] if cache is not None else None
        y, state = ssd_scan(hidden, self._time_steps(dt), -mx.exp(self.A_log.astype(mx.float32)), B, C,
                            self.chunk_size, state)
        if cache is not None:
            cache[1] = state
            cache.advance(length)
        y = y + hidden.astype(mx.float32) * self.D.astype(mx.float32)[:, None]  # the D skip
        y = y.reshape(batch, length, self.inner).astype(x.dtype)  # (B, L, I)
        y = self.norm(y, z) if "norm" in self else y * nn.silu(z)
        return self.out_proj(y)


class ParallelCache:
    """The cache of a layer whose attention has a Mamba-2 mixer beside it (Falcon-H1): the
    attention's KV cache and the mixer's ``StateCache``, advancing together. Positions and
    masks are the attention's; like any state, it cannot be trimmed (keep a ``copy``)."""

    def __init__(self, attention, mamba: StateCache):
        self.attention, self.mamba = attention, mamba

    @property
    def offset(self) -> int:
        return self.attention.offset

    def reserve(self, positions: int) -> None:
        self.attention.reserve(positions)

    def make_mask(self, length: int, window: int | None = None):
        return self.attention.make_mask(length, window)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return self.mamba.trim(n)  # refused unless n == 0

    def copy(self) -> "ParallelCache":
        import copy

        return ParallelCache(copy.deepcopy(self.attention), self.mamba.copy())

    @property
    def state(self) -> tuple:
        return (self.attention.state, self.mamba.state)

    @property
    def nbytes(self) -> int:
        return self.attention.nbytes + self.mamba.nbytes
