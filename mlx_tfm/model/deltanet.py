"""Gated DeltaNet: linear attention whose memory is a fixed-size matrix per head, written
by the gated delta rule (Qwen3-Next, Qwen3.5: the ``linear_attention`` layer type).

Each value head h keeps a state S (Dk, Dv). At every position, with a decay
``alpha = exp(g)`` in (0, 1] and a write strength ``beta`` in (0, 1):

    S = alpha * S                              # forget a little of everything
    S = S + k (beta * (v - k^T S))             # the delta rule: correct what S predicts for k
    o = q^T S

``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; q and k are
L2-normalised and q scaled by Dk^-1/2. Before this the projected q, k and v pass a causal
depthwise convolution (its last ``kernel - 1`` inputs are the layer's conv state) and
silu; after it the output is normed per head and gated, ``rms_norm(o) * silu(z)``, and
projected back to D.

Two forms of the same recurrence:
- ``delta_rule_steps``: position by position (decoding, short pieces);
- ``delta_rule_chunked``: chunks of ``chunk_size`` positions at once (prompts). Inside a
  chunk the writes are a unit lower-triangular system solved with matrix products (the
  UT transform of the DeltaNet paper); only the chunks run in order.
Both are plain MLX operations in float32, so they run on any device unchanged.

Chunks are of 16 positions by default (``linear_chunk_size``), not 64: a position costs
about 3 Dk Dv multiply-adds against the state whatever the chunk, plus some 5 C (Dk or Dv)
within its chunk, so smaller chunks do less work; the decays within a chunk are built from
few exponentials (``ChunkDecays``), which cost far more than products on the CPU.

Shapes: B batch, L positions, D hidden size; Hk key heads of Dk, Hv value heads of Dv (each
key head serves Hv / Hk consecutive value heads, as GQA).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..cpu import deltanet as cpu_deltanet
from ..errors import UserError
from .config import ModelArgs
from .state_cache import StateCache

# Up to this many new positions the step form runs (decoding, speculative drafts); longer
# pieces go chunk by chunk.
STEPS_UP_TO = 8


def l2_normalised(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / sqrt(sum(x^2) + eps) over the last axis (as transformers and FLA compute it)."""
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule_steps(queries, keys, values, g, beta, state):
    """The recurrence one position at a time. queries, keys (B, H, L, Dk), values
    (B, H, L, Dv), g and beta (B, H, L), state (B, H, Dk, Dv) -> (out (B, H, L, Dv), state).
    g may also be (B, H, L, Dk): a decay per key channel, scaling each row of S (Kimi's KDA)."""
    outputs = []
    for t in range(queries.shape[2]):
        decay = mx.exp(g[:, :, t])  # (B, H) per head, or (B, H, Dk) per key channel
        state = state * (decay[..., None, None] if decay.ndim == 2 else decay[..., None])
        k_t = keys[:, :, t]  # (B, H, Dk)
        predicted = (k_t[..., None] * state).sum(axis=-2)  # k^T S: (B, H, Dv)
        delta = (values[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., None] * delta[..., None, :]
        outputs.append((queries[:, :, t, :, None] * state).sum(axis=-2))  # q^T S: (B, H, Dv)
    return mx.stack(outputs, axis=2), state


def unit_lower_inverse(m: mx.array) -> mx.array:
    """The inverse of I + strictly_lower(m), m (..., n, n) with n a power of two, by
    doubling blocks: inv([[A, 0], [C, D]]) = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]. Matrix
    products only (no triangular solver, which MLX has on the CPU alone)."""
    *lead, n, _ = m.shape
    inverse = mx.ones((*lead, n, 1, 1), dtype=m.dtype)  # the 1x1 diagonal blocks
    size = 1
    while size < n:
        pairs = n // (2 * size)
        # (..., pairs, 2, size, pairs, 2, size): the lower-left block of pair p is [p, 1, :, p, 0, :]
        blocks = m.reshape(*lead, pairs, 2, size, pairs, 2, size)[..., :, 1, :, :, 0, :]
        lower_left = mx.moveaxis(mx.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # (..., pairs, size, size)
        halves = inverse.reshape(*lead, pairs, 2, size, size)
        upper, lower = halves[..., 0, :, :], halves[..., 1, :, :]
        corner = -(lower @ lower_left @ upper)
        top = mx.concatenate([upper, mx.zeros_like(upper)], axis=-1)  # (..., pairs, size, 2 size)
        bottom = mx.concatenate([corner, lower], axis=-1)
        inverse = mx.concatenate([top, bottom], axis=-2)  # (..., pairs, 2 size, 2 size)
        size *= 2
    return inverse.reshape(*lead, n, n)


def padded_to_chunks(x: mx.array, chunk_size: int) -> mx.array:
    """(B, H, L, ...) zero-padded to whole chunks -> (B, H, n_chunks, chunk_size, ...).
    Padded positions have g = beta = k = 0, so they leave the state as it was."""
    B, H, L = x.shape[:3]
    pad = -L % chunk_size
    if pad:
        x = mx.concatenate([x, mx.zeros((B, H, pad, *x.shape[3:]), dtype=x.dtype)], axis=2)
    return x.reshape(B, H, -1, chunk_size, *x.shape[3:])


def chunk_terms(queries, keys, values, g, beta):
    """What each chunk needs, all chunks at once (inputs as ``padded_to_chunks`` gives them).

    With the decay summed within the chunk, ``gamma_i = g_1 + ... + g_i``, a position j
    written before i reaches i scaled by exp(gamma_i - gamma_j). The chunk's own writes are
    ``u - w S0`` with ``(u, w) = T (beta v, beta k exp(gamma))`` and T the inverse of
    I + strictly_lower(beta_i k_i.k_j exp(gamma_i - gamma_j))."""
    C = g.shape[-1]
    decays = ChunkDecays(*compensated_cumsum(g))
    within_decays = decays.matrix()  # (B, H, n, C, C), zero above the diagonal
    beta_keys = keys * beta[..., None]
    writes = (beta_keys @ keys.swapaxes(-1, -2)) * within_decays * (1 - mx.eye(C, dtype=g.dtype))
    solve = unit_lower_inverse(writes)
    from_start = decays.from_start()[..., None]  # (B, H, n, C, 1)
    new_values = solve @ (values * beta[..., None])  # (B, H, n, C, Dv)
    decayed_keys = solve @ (beta_keys * from_start)  # (B, H, n, C, Dk)
    within = (queries @ keys.swapaxes(-1, -2)) * within_decays  # (B, H, n, C, C)
    reading = queries * from_start  # queries read S0 decayed to their position
    writing = keys * decays.to_end()[..., None]  # keys write S decayed to the chunk's end
    return new_values, decayed_keys, within, reading, writing, decays.whole_chunk()[..., None]


# Positions per block of ``ChunkDecays``: about the square root of the chunk sizes in use,
# which keeps both the exact in-block exponentials (C * BLOCK) and the between-block ones
# ((C / BLOCK)^2) few.
DECAY_BLOCK = 8


class ChunkDecays:
    """The decays within chunks, exp(gamma_i - gamma_j) for j <= i, from few exponentials.

    An exponential costs far more than a product on the CPU, and a chunk's (C, C) matrix
    would need C^2 of them. Split the chunk into blocks of ``DECAY_BLOCK`` positions; for i
    in block a and j in an earlier block b the exponent splits at two reference points,
    the end of block a - 1 (``start_a``) and the end of block b (``end_b``):

        exp(gamma_i - gamma_j) = exp(gamma_i - start_a) exp(start_a - end_b) exp(end_b - gamma_j)

    Every factor decays forward in time, so each is at most one: nothing overflows however
    strong the decay (exp(-gamma) alone would), and what underflows is a decay that small.
    Within a block the matrix is exact, as are the exponents: each is a difference of
    running sums with what their rounding lost (``compensated_cumsum``)."""

    def __init__(self, gamma: mx.array, lost: mx.array):
        C = gamma.shape[-1]
        self.size = min(DECAY_BLOCK, C)
        self.n_blocks = C // self.size
        # (..., C) -> (..., n_blocks, size)
        self.gamma = gamma.reshape(*gamma.shape[:-1], self.n_blocks, self.size)
        self.lost = lost.reshape(self.gamma.shape)
        self.ends = (self.gamma[..., -1], self.lost[..., -1])  # (..., n_blocks) each
        zero = mx.zeros_like(self.ends[0][..., :1])
        # block a starts where block a - 1 ended; the chunk starts at gamma = 0
        self.starts = tuple(mx.concatenate([zero, end[..., :-1]], axis=-1) for end in self.ends)

    def matrix(self) -> mx.array:
        """(..., C, C): exp(gamma_i - gamma_j) at j <= i, zero above the diagonal."""
        positions = (self.gamma, self.lost)
        inside = masked_exp(gap(positions, positions, -1, -2), mx.tril(mx.ones((self.size,) * 2, dtype=mx.bool_)))
        into = mx.exp(gap(positions, self.starts, None, -1))  # (..., n_blocks, size): exp(gamma_i - start_a)
        out_of = mx.exp(gap(self.ends, positions, -1, None))  # exp(end_b - gamma_j)
        earlier = mx.tril(mx.ones((self.n_blocks,) * 2, dtype=mx.bool_), -1)  # b < a
        between = masked_exp(gap(self.starts, self.ends, -1, -2), earlier)  # (..., n_blocks, n_blocks)
        # (..., a, i, b, j): the three factors across blocks, the exact ones on the diagonal blocks
        across = into[..., :, :, None, None] * between[..., :, None, :, None] * out_of[..., None, None, :, :]
        same_block = mx.eye(self.n_blocks, dtype=inside.dtype)[:, None, :, None]
        matrix = across + inside[..., :, :, None, :] * same_block
        C = self.n_blocks * self.size
        return matrix.reshape(*matrix.shape[:-4], C, C)  # (..., n_blocks, size, n_blocks, size) -> (..., C, C)

    def from_start(self) -> mx.array:
        """(..., C): exp(gamma_i), the decay from the chunk's start to each position."""
        into_block = mx.exp(gap((self.gamma, self.lost), self.starts, None, -1))  # (..., n_blocks, size)
        return self._flat(into_block * mx.exp(self.starts[0] + self.starts[1])[..., None])

    def to_end(self) -> mx.array:
        """(..., C): exp(gamma_C - gamma_i), the decay from each position to the chunk's end."""
        last = tuple(end[..., -1:] for end in self.ends)  # (..., 1) each
        to_block_end = mx.exp(gap(self.ends, (self.gamma, self.lost), -1, None))
        return self._flat(to_block_end * mx.exp(gap(last, self.ends, None, None))[..., None])

    def whole_chunk(self) -> mx.array:
        """(..., 1): exp(gamma_C), the decay over the whole chunk."""
        return mx.exp(self.ends[0][..., -1:] + self.ends[1][..., -1:])

    def _flat(self, blocks: mx.array) -> mx.array:
        return blocks.reshape(*blocks.shape[:-2], -1)  # (..., n_blocks, size) -> (..., C)


def gap(later, earlier, later_axis, earlier_axis) -> mx.array:
    """later - earlier for two (sums, lost) pairs, each first given a new axis at
    ``later_axis`` / ``earlier_axis`` (None: as it is) so that they broadcast."""
    def expanded(pair, axis):
        return pair if axis is None else tuple(mx.expand_dims(t, axis) for t in pair)

    later_sums, later_lost = expanded(later, later_axis)
    earlier_sums, earlier_lost = expanded(earlier, earlier_axis)
    return (later_sums - earlier_sums) + (later_lost - earlier_lost)


def masked_exp(exponents: mx.array, mask: mx.array) -> mx.array:
    """exp where ``mask`` holds, zero elsewhere (never an exponential of what is masked
    out, which may overflow)."""
    return mx.exp(mx.where(mask, exponents, -mx.inf))


def compensated_cumsum(g: mx.array) -> tuple[mx.array, mx.array]:
    """The running sum of g over the last axis as (sums, what rounding dropped from them).
    Within a chunk the sums grow to hundreds while the decay between two nearby positions
    is a difference of two of them; the dropped part keeps that difference precise."""
    sums = mx.cumsum(g, axis=-1)
    steps = sums - mx.concatenate([mx.zeros_like(sums[..., :1]), sums[..., :-1]], axis=-1)  # exact differences
    return sums, mx.cumsum(g - steps, axis=-1)


def delta_rule_chunked(queries, keys, values, g, beta, state, chunk_size: int = 16):
    """The recurrence ``chunk_size`` positions at a time: the same numbers as
    ``delta_rule_steps`` (same arguments and results), in L / chunk_size sequential steps;
    on the CPU one kernel call (cpu/deltanet.py), elsewhere ``plain_delta_rule_chunked``."""
    if cpu_deltanet.takes(g):
        return cpu_deltanet.delta_rule_chunked(plain_delta_rule_chunked, queries, keys, values, g, beta, state,
                                               chunk_size)
    return plain_delta_rule_chunked(queries, keys, values, g, beta, state, chunk_size)


def plain_delta_rule_chunked(queries, keys, values, g, beta, state, chunk_size: int = 16):
    """``delta_rule_chunked`` in MLX ops: what Metal and CUDA run, and its gradients."""
    L = queries.shape[2]
    chunked = [padded_to_chunks(t, chunk_size) for t in (queries, keys, values, g, beta)]
    new_values, decayed_keys, within, reading, writing, chunk_decay = chunk_terms(*chunked)
    writing = writing.swapaxes(-1, -2)  # (B, H, n, Dk, C): keys as they write the state
    outputs = []
    for i in range(new_values.shape[2]):
        out, state = across_chunk(state, new_values[:, :, i], decayed_keys[:, :, i], reading[:, :, i],
                                  within[:, :, i], writing[:, :, i], chunk_decay[:, :, i])
        outputs.append(out)
    out = mx.concatenate(outputs, axis=2)  # (B, H, n * C, Dv)
    return out[:, :, :L], state


def chunk_from_state(state, new_values, decayed_keys, reading, within, writing, chunk_decay):
    """One chunk against the state it starts from (B, H, Dk, Dv): its outputs (B, H, C, Dv)
    and the state after it. The chunk's corrected writes are what it wrote less what the
    state already predicted for its keys."""
    corrected = new_values - decayed_keys @ state  # (B, H, C, Dv)
    out = reading @ state + within @ corrected
    return out, state * chunk_decay + writing @ corrected


# Compiled, the state's decay and the write fuse into one pass over the (Dk, Dv) state (the
# step runs L / chunk_size times, on arrays of the same shapes each time).
across_chunk = mx.compile(chunk_from_state)


def causal_depthwise_conv(inputs: mx.array, weight: mx.array) -> mx.array:
    """inputs (B, K - 1 + L, C) (the state, then the new positions), weight (C, K, 1) ->
    (B, L, C): out_t = sum_k inputs_{t + k} * weight_k, each channel on its own."""
    K = weight.shape[1]
    L = inputs.shape[1] - (K - 1)
    taps = weight[:, :, 0].T  # (K, C)
    out = inputs[:, 0:L] * taps[0]
    for k in range(1, K):
        out = out + inputs[:, k : k + L] * taps[k]
    return out


def cached_delta_rule(queries, keys, values, g, beta, cache, chunked, chunk_size: int) -> mx.array:
    """The delta rule over (B, H, L, ...) heads, from the cache's recurrent state (zeros
    without one): stepped for up to ``STEPS_UP_TO`` positions, else ``chunked``; the new
    state goes back into the cache (slot 1), which counts the positions. -> (B, H, L, Dv)"""
    B, H, L, Dk = keys.shape
    state = cache[1] if cache is not None and cache[1] is not None else mx.zeros(
        (B, H, Dk, values.shape[-1]), dtype=mx.float32)
    if L <= STEPS_UP_TO:
        out, state = delta_rule_steps(queries, keys, values, g, beta, state)
    else:
        out, state = chunked(queries, keys, values, g, beta, state, chunk_size)
    if cache is not None:
        cache[1] = state
        cache.advance(L)
    return out


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * gate(z)`` over each head's values (weight starts at one);
    the gate is silu (Qwen's Gated DeltaNet) or sigmoid (Kimi's KDA)."""

    def __init__(self, dims: int, eps: float, gate: Callable[[mx.array], mx.array] = nn.silu):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self.gate = gate

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        return (normed * self.gate(gate.astype(mx.float32))).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """The ``linear_attention`` mixer (``linear_attn.*`` in checkpoints): projections,
    causal convolution, the gated delta rule, the gated norm and ``out_proj``. Fused
    checkpoints (Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba``) are split into these
    projections when loaded (``families/hybrids.py``)."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        check_linear_heads(args)
        D = args.hidden_size
        self.n_key_heads, self.n_value_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim = self.n_key_heads * self.key_head_dim
        self.value_dim = self.n_value_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = args.linear_conv_kernel_dim
        self.chunk_size = args.linear_chunk_size
        self.in_proj_qkv = nn.Linear(D, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.n_value_heads, bias=False)
        self.in_proj_a = nn.Linear(D, self.n_value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = mx.ones((self.n_value_heads,))
        self.A_log = mx.log(mx.random.uniform(1.0, 16.0, (self.n_value_heads,)))
        self.norm = GatedRMSNorm(self.value_head_dim, args.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)

    def make_cache(self) -> StateCache:
        """[conv_state (B, kernel - 1, conv_dim), recurrent_state (B, Hv, Dk, Dv)]."""
        return StateCache(2)

    def __call__(self, x: mx.array, mask=None, cache: StateCache | None = None) -> mx.array:
        B, L, _ = x.shape
        mixed = self._convolved(self.in_proj_qkv(x), cache)  # (B, L, conv_dim)
        queries, keys, values = self._heads(mixed)
        beta = mx.sigmoid(self.in_proj_b(x).astype(mx.float32))  # (B, L, Hv)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(
            self.in_proj_a(x).astype(mx.float32) + self.dt_bias.astype(mx.float32))
        # -> (B, Hv, L, ...): the heads' layout the recurrence works in
        queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
        g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)
        out = cached_delta_rule(queries, keys, values, g, beta, cache, delta_rule_chunked, self.chunk_size)
        out = out.transpose(0, 2, 1, 3).astype(x.dtype)  # (B, L, Hv, Dv)
        z = self.in_proj_z(x).reshape(B, L, self.n_value_heads, self.value_head_dim)
        return self.out_proj(self.norm(out, z).reshape(B, L, -1))

    def _convolved(self, mixed: mx.array, cache: StateCache | None) -> mx.array:
        """silu(causal conv) of the projected q, k, v (B, L, conv_dim); the last kernel - 1
        inputs become the cache's conv state."""
        B = mixed.shape[0]
        previous = cache[0] if cache is not None and cache[0] is not None else mx.zeros(
            (B, self.kernel_size - 1, self.conv_dim), dtype=mixed.dtype)
        inputs = mx.concatenate([previous.astype(mixed.dtype), mixed], axis=1)  # (B, K - 1 + L, conv_dim)
        if cache is not None:
            cache[0] = mx.contiguous(inputs[:, inputs.shape[1] - (self.kernel_size - 1):])
        return nn.silu(causal_depthwise_conv(inputs, self.conv1d.weight))

    def _heads(self, mixed: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(B, L, conv_dim) -> queries, keys (B, L, Hv, Dk) normalised (queries scaled) and
        repeated over each key head's value heads, values (B, L, Hv, Dv), in float32."""
        B, L, _ = mixed.shape
        mixed = mixed.astype(mx.float32)
        queries, keys, values = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        # (B, L, heads * head_dim) -> (B, L, heads, head_dim)
        queries = queries.reshape(B, L, self.n_key_heads, self.key_head_dim)
        keys = keys.reshape(B, L, self.n_key_heads, self.key_head_dim)
        values = values.reshape(B, L, self.n_value_heads, self.value_head_dim)
        queries = l2_normalised(queries) * self.key_head_dim ** -0.5
        keys = l2_normalised(keys)
        repeats = self.n_value_heads // self.n_key_heads
        if repeats > 1:
            queries, keys = mx.repeat(queries, repeats, axis=2), mx.repeat(keys, repeats, axis=2)
        return queries, keys, values


def check_linear_heads(args: ModelArgs) -> None:
    """UserError naming the numbers when the linear-attention heads cannot be laid out."""
    n_key, n_value = args.linear_num_key_heads, args.linear_num_value_heads
    dims = (args.linear_key_head_dim, args.linear_value_head_dim)
    if n_key < 1 or n_value < 1 or min(dims) < 1:
        raise UserError("linear_attention layers need linear_num_key_heads, linear_num_value_heads, "
                        "linear_key_head_dim and linear_value_head_dim (each at least 1)")
    if n_value % n_key:
        raise UserError(f"linear_num_value_heads ({n_value}) is not a multiple of linear_num_key_heads ({n_key})")
    if args.linear_chunk_size < 1 or args.linear_chunk_size & (args.linear_chunk_size - 1):
        raise UserError(f"linear_chunk_size must be a power of two, not {args.linear_chunk_size}")
    if args.linear_conv_kernel_dim < 2:
        raise UserError(f"linear_conv_kernel_dim must be at least 2, not {args.linear_conv_kernel_dim}")
