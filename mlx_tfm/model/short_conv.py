"""LFM2's gated short convolution: the token mixer of its "conv" layers.

    B, C, x = in_proj(x)                      # three (B, L, D) gates and values
    y = out_proj(C * conv(B * x))             # conv: causal, depthwise, K = conv_L_cache taps

Each channel is convolved with its own K taps over the current and the K - 1 previous
positions, so the layer's whole memory of the past is the last K - 1 inputs of the
convolution: a ``StateCache(1)`` holding them (B, K - 1, D), zeros before the first
position. Prefilling in pieces and decoding one position at a time read the same inputs
as one full forward.

Shapes: B batch, L new positions, D hidden size, K the kernel's taps.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .state_cache import StateCache


class ShortConv(nn.Module):
    """Parameter names follow the checkpoint: ``in_proj``, ``conv`` (depthwise, its weight
    (D, K, 1) as MLX lays out a grouped Conv1d), ``out_proj``."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        D, K = args.hidden_size, args.conv_L_cache
        if K < 1:
            raise ValueError(f"conv_L_cache must be at least 1, not {K}")
        self.kernel_size = K
        self.in_proj = nn.Linear(D, 3 * D, bias=args.conv_bias)
        self.conv = nn.Conv1d(D, D, K, groups=D, bias=args.conv_bias)
        self.out_proj = nn.Linear(D, D, bias=args.conv_bias)

    def make_cache(self) -> StateCache:
        """One state array: the convolution's last K - 1 inputs."""
        return StateCache(1)

    def __call__(self, x: mx.array, mask=None, cache: StateCache | None = None) -> mx.array:
        """x (B, L, D) -> (B, L, D). ``mask`` is ignored: the convolution is causal."""
        gate_in, gate_out, values = mx.split(self.in_proj(x), 3, axis=-1)  # (B, L, D) each
        gated = gate_in * values
        history = self._history(gated, cache)  # (B, K - 1, D)
        window = mx.concatenate([history, gated], axis=1)  # (B, K - 1 + L, D)
        if cache is not None:
            cache[0] = window[:, window.shape[1] - (self.kernel_size - 1):, :]
            cache.advance(x.shape[1])
        # A valid (unpadded) convolution over K - 1 + L inputs gives exactly L outputs.
        return self.out_proj(gate_out * self.conv(window))

    def _history(self, gated: mx.array, cache: StateCache | None) -> mx.array:
        """The K - 1 inputs before this chunk: the cache's, or zeros at the start."""
        if cache is not None and cache[0] is not None:
            return cache[0].astype(gated.dtype)
        B, _, D = gated.shape
        return mx.zeros((B, self.kernel_size - 1, D), dtype=gated.dtype)
