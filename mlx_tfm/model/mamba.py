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

    @state.setter
    def state(self, value) -> None:
        """``(attention's keys and values, the mixer's state arrays)``, as ``state`` gives
        them; an empty part (nothing written yet) leaves that cache as it is."""
        attention_state, mamba_state = value
        if attention_state:
            self.attention.state = attention_state
        if mamba_state:
            self.mamba.state = mamba_state

    @property
    def meta_state(self) -> dict:
        return {"kind": "ParallelCache", "attention": self.attention.meta_state, "mamba": self.mamba.meta_state}

    @meta_state.setter
    def meta_state(self, meta: dict) -> None:
        if meta["attention"]["kind"] != "KVCache":  # a plain KV cache has no settings to restore
            self.attention.meta_state = meta["attention"]
        self.mamba.meta_state = meta["mamba"]

    @property
    def nbytes(self) -> int:
        return self.attention.nbytes + self.mamba.nbytes


# -- Mamba-1 (layer type "mamba1"): the selective scan with a decay per channel and state ---


def selective_scan_chunk(decay: mx.array, inputs: mx.array, state: mx.array) -> mx.array:
    """The states after each position of one chunk: decay and inputs (B, T, I, N), the
    state before it (B, I, N) -> (B, T, I, N). ``state_t = decay_t * state_{t-1} + inputs_t``
    unrolled in log2(T) doubling steps (each position combines with the one k back), which
    only ever multiplies decays <= 1, so it stays stable at any chunk length."""
    length, k = decay.shape[1], 1
    while k < length:
        earlier_inputs = mx.concatenate([mx.zeros_like(inputs[:, :k]), inputs[:, :-k]], axis=1)
        earlier_decay = mx.concatenate([mx.ones_like(decay[:, :k]), decay[:, :-k]], axis=1)
        inputs = inputs + decay * earlier_inputs
        decay = decay * earlier_decay
        k *= 2
    return inputs + decay * state[:, None]


def selective_scan(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array, chunk_size: int,
                   state: mx.array | None) -> tuple[mx.array, mx.array]:
    """Mamba-1's scan: x and dt (B, L, I), A (I, N) (negative), B and C (B, L, N), state
    (B, I, N) or None -> (y (B, L, I) without the D skip, the final state). A prompt is
    scanned ``chunk_size`` positions at a time; one position is the recurrence's one step."""
    batch, length, inner = x.shape
    if state is None:
        state = mx.zeros((batch, inner, A.shape[1]), dtype=mx.float32)
    x, dt, B, C = (t.astype(mx.float32) for t in (x, dt, B, C))
    ys = []
    for start in range(0, length, chunk_size):
        piece = slice(start, start + chunk_size)
        decay = mx.exp(dt[:, piece, :, None] * A)  # (B, T, I, N)
        inputs = (dt[:, piece] * x[:, piece])[..., None] * B[:, piece, None, :]  # (B, T, I, N)
        states = selective_scan_chunk(decay, inputs, state)  # one position: the step form
        ys.append((states @ C[:, piece, :, None])[..., 0])  # (B, T, I)
        state = states[:, -1]
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), state


class Mamba1Mixer(nn.Module):
    """Mamba-1, as transformers' MambaMixer: in_proj -> (x, z); x -> causal conv -> silu;
    x_proj(x) -> (dt low-rank, B, C); dt = softplus(dt_proj(dt)); the selective scan with
    A = -exp(A_log) (I, N); + D x; times silu(z); out_proj. Cache: ``StateCache(2)``,
    [conv_state (B, K - 1, I), ssm_state (B, I, N)]."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.inner, self.state_size = args.mamba_inner_size, args.mamba_state_size
        self.dt_rank, self.conv_kernel, self.chunk_size = args.mamba_dt_rank, args.mamba_conv_kernel, args.mamba_chunk_size
        D = args.hidden_size
        self.in_proj = nn.Linear(D, 2 * self.inner, bias=args.mamba_proj_bias)
        self.conv1d = CausalConv1d(self.inner, self.conv_kernel, args.mamba_conv_bias)
        self.x_proj = nn.Linear(self.inner, self.dt_rank + 2 * self.state_size, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.inner, bias=True)
        self.A_log = mx.log(mx.broadcast_to(mx.arange(1, self.state_size + 1, dtype=mx.float32), (self.inner, self.state_size)))
        self.D = mx.ones((self.inner,))
        self.out_proj = nn.Linear(self.inner, D, bias=args.mamba_out_proj_bias)

    def make_cache(self) -> StateCache:
        return StateCache(2)

    def __call__(self, x: mx.array, mask=None, cache: StateCache | None = None) -> mx.array:
        """x (B, L, D) -> (B, L, D); ``mask`` is unused (the scan is causal by construction)."""
        hidden, z = mx.split(self.in_proj(x), 2, axis=-1)  # (B, L, I) each
        keep = self.conv_kernel - 1
        past = cache[0] if cache is not None and cache[0] is not None else mx.zeros(
            (x.shape[0], keep, self.inner), dtype=hidden.dtype)
        padded = mx.concatenate([past, hidden], axis=1)  # (B, K - 1 + L, I)
        if cache is not None:
            cache[0] = padded[:, padded.shape[1] - keep :]
        hidden = nn.silu(self.conv1d(padded))
        dt, B, C = mx.split(self.x_proj(hidden), [self.dt_rank, self.dt_rank + self.state_size], axis=-1)
        dt = nn.softplus(self.dt_proj(dt).astype(mx.float32))  # (B, L, I)
        A = -mx.exp(self.A_log.astype(mx.float32))
        y, state = selective_scan(hidden, dt, A, B, C, self.chunk_size, cache[1] if cache is not None else None)
        if cache is not None:
            cache[1] = state
            cache.advance(x.shape[1])
        y = (y + hidden.astype(mx.float32) * self.D.astype(mx.float32)).astype(x.dtype)
        return self.out_proj(y * nn.silu(z))
