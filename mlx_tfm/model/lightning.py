"""Lightning attention (MiniMax-Text-01: the ``lightning_attention`` layer type): linear
attention whose state decays at a fixed rate per head.

Each head h keeps a state S (Dk, Dv); at every position, with ``g = -slope_h``:

    S = exp(g) S + k v^T           # forget a fixed share, add the new pair (no delta rule)
    o = q^T S

q, k and v are ``act(qkv_proj(x))`` split per head (no normalisation, no scale). The
slopes are ALiBi's, ``(2^(-8 / H))^(h + 1)``, shrunk with depth by
``1 - layer_idx / (num_layers - 1) + 1e-5`` (the last layer barely forgets). The output is
RMS-normed over all heads together (epsilon 1e-6), gated by ``sigmoid(output_gate(x))`` and
projected back to D.

Two forms of the recurrence, as for the delta rule (``deltanet.py``):
- ``lightning_steps``: position by position (decoding);
- ``lightning_chunked``: chunks of positions at once, attention-like inside a chunk (scores
  ``q_i . k_j`` times the decay between i and j), only the state passing between chunks.

Shapes: B batch, L positions, D hidden size, H heads of Dh (queries, keys and values).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError
from .config import ModelArgs
from .deltanet import STEPS_UP_TO, compensated_cumsum, padded_to_chunks
from .layers import ACTIVATIONS, RMSNorm
from .state_cache import StateCache

# MiniMaxRMSNorm's default, which the lightning layers' output norm keeps.
OUTPUT_NORM_EPS = 1e-6


def lightning_slopes(n_heads: int, layer_idx: int, n_layers: int) -> mx.array:
    """The decay rate of each head, (H,): larger for early heads and early layers."""
    base = 2 ** (-8 / n_heads)
    depth = 1 - layer_idx / (n_layers - 1 + 1e-5) + 1e-5
    return mx.array([base ** (h + 1) * depth for h in range(n_heads)], dtype=mx.float32)


def lightning_steps(queries, keys, values, g, state):
    """queries, keys (B, H, L, Dk), values (B, H, L, Dv), g (B, H, L), state (B, H, Dk, Dv)
    -> (out (B, H, L, Dv), state)."""
    outputs = []
    for t in range(queries.shape[2]):
        state = state * mx.exp(g[:, :, t])[..., None, None] + keys[:, :, t, :, None] * values[:, :, t, None, :]
        outputs.append((queries[:, :, t, :, None] * state).sum(axis=-2))  # q^T S: (B, H, Dv)
    return mx.stack(outputs, axis=2), state


def lightning_chunked(queries, keys, values, g, state, chunk_size: int = 64):
    """The same recurrence ``chunk_size`` positions at a time (same arguments and results).
    Padded positions have g = k = 0, so they leave the state as it was."""
    L, C = queries.shape[2], chunk_size
    queries, keys, values, g = (padded_to_chunks(t, C) for t in (queries, keys, values, g))
    gamma, lost = compensated_cumsum(g)  # (B, H, n, C): the decay summed within the chunk
    gaps = (gamma[..., :, None] - gamma[..., None, :]) + (lost[..., :, None] - lost[..., None, :])
    decays = mx.exp(mx.where(mx.tril(mx.ones((C, C), dtype=mx.bool_)), gaps, -mx.inf))  # (B, H, n, C, C)
    within = (queries @ keys.swapaxes(-1, -2)) * decays  # (B, H, n, C, C)
    reading = queries * mx.exp(gamma)[..., None]  # queries read the incoming state decayed to them
    to_end = (gamma[..., -1:] - gamma) + (lost[..., -1:] - lost)
    writing = keys * mx.exp(to_end)[..., None]  # keys write the state decayed to the chunk's end
    chunk_decay = mx.exp(gamma[..., -1:])[..., None]  # (B, H, n, 1, 1)
    outputs = []
    for i in range(queries.shape[2]):
        outputs.append(reading[:, :, i] @ state + within[:, :, i] @ values[:, :, i])
        state = state * chunk_decay[:, :, i] + writing[:, :, i].swapaxes(-1, -2) @ values[:, :, i]
    out = mx.concatenate(outputs, axis=2)  # (B, H, n * C, Dv)
    return out[:, :, :L], state


class LightningAttention(nn.Module):
    """The ``lightning_attention`` mixer (``self_attn.*`` in MiniMax checkpoints)."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        if args.hidden_act not in ACTIVATIONS:
            raise UserError(f"lightning attention with hidden_act {args.hidden_act!r} is not supported")
        D, H, Dh = args.hidden_size, args.num_attention_heads, args.head_dim
        self.n_heads, self.head_dim, self.chunk_size = H, Dh, args.linear_chunk_size
        self.act = ACTIVATIONS[args.hidden_act]
        self.qkv_proj = nn.Linear(D, 3 * H * Dh, bias=False)
        self.output_gate = nn.Linear(D, H * Dh, bias=False)
        self.norm = RMSNorm(H * Dh, OUTPUT_NORM_EPS)
        self.out_proj = nn.Linear(H * Dh, D, bias=False)
        self._slopes = lightning_slopes(H, layer_idx, args.num_hidden_layers)  # fixed, not a weight

    def make_cache(self) -> StateCache:
        """[state (B, H, Dh, Dh)]."""
        return StateCache(1)

    def __call__(self, x: mx.array, mask=None, cache: StateCache | None = None) -> mx.array:
        B, L, _ = x.shape
        # (B, L, 3 H Dh) -> (B, L, H, 3, Dh) -> (3, B, H, L, Dh): each head's q, k, v side by side
        qkv = self.act(self.qkv_proj(x)).astype(mx.float32).reshape(B, L, self.n_heads, 3, self.head_dim)
        queries, keys, values = qkv.transpose(3, 0, 2, 1, 4)
        g = mx.broadcast_to(-self._slopes[None, :, None], (B, self.n_heads, L))
        state = cache[0] if cache is not None and cache[0] is not None else mx.zeros(
            (B, self.n_heads, self.head_dim, self.head_dim), dtype=mx.float32)
        if L <= STEPS_UP_TO:
            out, state = lightning_steps(queries, keys, values, g, state)
        else:
            out, state = lightning_chunked(queries, keys, values, g, state, self.chunk_size)
        if cache is not None:
            cache[0] = state
            cache.advance(L)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1).astype(x.dtype)  # (B, H, L, Dh) -> (B, L, H Dh)
        return self.out_proj(mx.sigmoid(self.output_gate(x)) * self.norm(out))


__all__ = ["LightningAttention", "lightning_chunked", "lightning_steps", "lightning_slopes"]
