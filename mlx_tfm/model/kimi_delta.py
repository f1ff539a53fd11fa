"""Kimi Delta Attention (KDA, Kimi Linear: the ``kimi_delta_attention`` layer type): the
gated delta rule of ``deltanet.py`` with a decay per key channel instead of one per head.

Each head h keeps a state S (Dk, Dv). At every position, with a decay ``alpha = exp(g)``
now a vector over the Dk key channels and a write strength ``beta`` in (0, 1):

    S = diag(alpha) S                          # each key channel's row forgets at its own rate
    S = S + k (beta * (v - k^T S))             # the delta rule
    o = q^T S

``g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)`` (a low-rank projection, one value
per channel), ``beta = sigmoid(b_proj(x))``. q, k and v each pass their own causal
depthwise convolution and silu, q and k are L2-normalised and q scaled by Dk^-1/2. The
output is normed per head and gated by a sigmoid, ``rms_norm(o) * sigmoid(g_b(g_a(x)))``,
then projected back to D.

The step form is ``deltanet.delta_rule_steps`` (which takes either decay); the chunked form
is here: with a decay per channel the within-chunk decay between positions i and j is no
scalar, so ``k_i . k_j`` becomes ``sum_d k_i[d] k_j[d] exp(gamma_i[d] - gamma_j[d])``, made
from the pairwise differences (never from exp(-gamma) alone, which overflows for strong
decays). The chunks run one after another, so only one chunk's (C, C, Dk) decays exist at
a time.

Shapes: B batch, L positions, D hidden size, H heads of Dk (keys) and Dv (values).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .deltanet import (GatedRMSNorm, cached_delta_rule, causal_depthwise_conv, check_linear_heads,
                       compensated_cumsum, l2_normalised, padded_to_chunks, unit_lower_inverse)
from .state_cache import StateCache


def per_channel_chunk(queries, keys, values, g, beta, state):
    """One chunk of C positions: queries, keys, g (B, H, C, Dk), values (B, H, C, Dv), beta
    (B, H, C), state (B, H, Dk, Dv) -> (out (B, H, C, Dv), state after the chunk)."""
    C = g.shape[-2]
    sums, lost = compensated_cumsum(g.swapaxes(-1, -2))  # over positions: (B, H, Dk, C) each
    gamma, lost = sums.swapaxes(-1, -2), lost.swapaxes(-1, -2)  # (B, H, C, Dk)
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))[..., None]  # (C, C, 1): j <= i
    gaps = (gamma[..., :, None, :] - gamma[..., None, :, :]) + (lost[..., :, None, :] - lost[..., None, :, :])
    decays = mx.exp(mx.where(lower, gaps, -mx.inf))  # (B, H, C, C, Dk): exp(gamma_i - gamma_j), 0 for j > i
    beta_keys = keys * beta[..., None]
    # writes[i, j] = beta_i sum_d k_i[d] k_j[d] decay_ij[d], strictly below the diagonal
    writes = (beta_keys[..., :, None, :] * keys[..., None, :, :] * decays).sum(-1) * (1 - mx.eye(C, dtype=g.dtype))
    solve = unit_lower_inverse(writes)  # (B, H, C, C)
    corrected = solve @ (values * beta[..., None]) - (solve @ (beta_keys * mx.exp(gamma))) @ state  # (B, H, C, Dv)
    within = (queries[..., :, None, :] * keys[..., None, :, :] * decays).sum(-1)  # (B, H, C, C)
    out = (queries * mx.exp(gamma)) @ state + within @ corrected
    to_end = (gamma[..., -1:, :] - gamma) + (lost[..., -1:, :] - lost)  # (B, H, C, Dk)
    state = state * mx.exp(gamma[..., -1, :])[..., None] + (keys * mx.exp(to_end)).swapaxes(-1, -2) @ corrected
    return out, state


def per_channel_delta_rule_chunked(queries, keys, values, g, beta, state, chunk_size: int = 64):
    """The recurrence with a decay per key channel, ``chunk_size`` positions at a time:
    g (B, H, L, Dk), the rest as ``delta_rule_steps``, and the same numbers."""
    L = queries.shape[2]
    chunked = [padded_to_chunks(t, chunk_size) for t in (queries, keys, values, g, beta)]
    outputs = []
    for i in range(chunked[0].shape[2]):
        out, state = per_channel_chunk(*(t[:, :, i] for t in chunked), state)
        outputs.append(out)
    out = mx.concatenate(outputs, axis=2)  # (B, H, n * C, Dv)
    return out[:, :, :L], state


def sigmoid_gate(gate: mx.array) -> mx.array:
    return mx.sigmoid(gate)


class KimiDeltaAttention(nn.Module):
    """The ``kimi_delta_attention`` mixer (``self_attn.*`` in Kimi Linear checkpoints)."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        check_linear_heads(args)
        D = args.hidden_size
        self.n_heads, self.head_dim = args.linear_num_value_heads, args.linear_key_head_dim
        width = self.n_heads * self.head_dim
        self.kernel_size, self.chunk_size = args.linear_conv_kernel_dim, args.linear_chunk_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, width, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, self.kernel_size, groups=width, bias=False) for _ in range(3))
        self.f_a_proj = nn.Linear(D, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.A_log = mx.log(mx.random.uniform(1.0, 16.0, (1, 1, self.n_heads, 1)))  # the checkpoint's shape
        self.dt_bias = mx.zeros((width,))
        self.b_proj = nn.Linear(D, self.n_heads, bias=False)
        self.g_a_proj = nn.Linear(D, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, args.norm_eps, gate=sigmoid_gate)
        self.o_proj = nn.Linear(width, D, bias=False)

    def make_cache(self) -> StateCache:
        """[conv_state (B, kernel - 1, 3 * H * Dk) of q, k, v, recurrent_state (B, H, Dk, Dv)]."""
        return StateCache(2)

    def __call__(self, x: mx.array, mask=None, cache: StateCache | None = None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self._heads(self._convolved(x, cache))  # (B, H, L, Dk or Dv) each
        beta = mx.sigmoid(self.b_proj(x).astype(mx.float32)).transpose(0, 2, 1)  # (B, H, L)
        g = self._decay(x).transpose(0, 2, 1, 3)  # (B, H, L, Dk)
        out = cached_delta_rule(queries, keys, values, g, beta, cache, per_channel_delta_rule_chunked,
                                self.chunk_size)
        out = out.transpose(0, 2, 1, 3).astype(x.dtype)  # (B, L, H, Dv)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, L, self.n_heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(B, L, -1))

    def _decay(self, x: mx.array) -> mx.array:
        """g (B, L, H, Dk): the log of each key channel's decay, at most 0."""
        B, L, _ = x.shape
        logits = self.f_b_proj(self.f_a_proj(x)).astype(mx.float32) + self.dt_bias.astype(mx.float32)
        logits = logits.reshape(B, L, self.n_heads, self.head_dim)  # (B, L, H * Dk) -> (B, L, H, Dk)
        rate = mx.exp(self.A_log.astype(mx.float32).reshape(self.n_heads, 1))  # (H, 1): one per head
        return -rate * nn.softplus(logits)

    def _convolved(self, x: mx.array, cache: StateCache | None) -> mx.array:
        """silu(causal conv) of q, k, v side by side (B, L, 3 H Dk); the last kernel - 1
        inputs become the cache's conv state."""
        mixed = mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)  # (B, L, 3 H Dk)
        B, width = mixed.shape[0], mixed.shape[-1]
        previous = cache[0] if cache is not None and cache[0] is not None else mx.zeros(
            (B, self.kernel_size - 1, width), dtype=mixed.dtype)
        inputs = mx.concatenate([previous.astype(mixed.dtype), mixed], axis=1)  # (B, K - 1 + L, 3 H Dk)
        if cache is not None:
            cache[0] = mx.contiguous(inputs[:, inputs.shape[1] - (self.kernel_size - 1):])
        weight = mx.concatenate([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])  # (3 H Dk, K, 1)
        return nn.silu(causal_depthwise_conv(inputs, weight))

    def _heads(self, mixed: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(B, L, 3 H Dk) -> queries (normalised, scaled), keys (normalised), values, each
        (B, H, L, Dk) in float32."""
        B, L, _ = mixed.shape
        # (B, L, 3 H Dk) -> (B, L, 3, H, Dk) -> (3, B, H, L, Dk)
        heads = mixed.astype(mx.float32).reshape(B, L, 3, self.n_heads, self.head_dim).transpose(2, 0, 3, 1, 4)
        queries = l2_normalised(heads[0]) * self.head_dim ** -0.5
        return queries, l2_normalised(heads[1]), heads[2]


__all__ = ["KimiDeltaAttention", "per_channel_delta_rule_chunked"]
