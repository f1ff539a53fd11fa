"""The state-space duality (SSD) scan of Mamba-2 in its two forms, plain MLX ops only.

Per head h the recurrence over positions t is
    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t (outer) B_t      (head_dim, state_size)
    y_t     = state_t @ C_t
- ``ssd_step`` runs it one position at a time (decoding);
- ``ssd_chunked`` reads a prompt a chunk at a time (Mamba-2 paper, section 6): inside a
  chunk the recurrence unrolls into a masked, decayed attention-like product
  ``(C B^T * decay) @ (dt x)``, and only the state crosses from one chunk to the next, so a
  prompt costs a few matrix products per chunk instead of one small update per position.

The result does not depend on the chunk size, only the speed does: on the CPU a chunk
costs T exponentials and about T (N + P) multiply-adds per position and head inside it
(the T x T decays and products), against a fixed N P for the state across chunks, so the
chunks there are of at most ``CPU_CHUNK`` positions whatever the checkpoint's chunk size
(256 in Mamba-2's, a GPU kernel's tile).

Shapes: B batch, L positions, H heads, P head_dim, G groups of B and C (each serving H / G
consecutive heads), N state_size, T positions in a chunk. Everything runs in float32; the
caller casts the output back.
"""

from __future__ import annotations

import mlx.core as mx

from ..cpu import on_cpu

# The most positions per chunk on the CPU route (``working_chunk``).
CPU_CHUNK = 64


def grouped(t: mx.array, n_groups: int) -> mx.array:
    """(B, H, ...) -> (B, G, H / G, ...): head h belongs to group h // (H / G)."""
    return t.reshape(t.shape[0], n_groups, t.shape[1] // n_groups, *t.shape[2:])


def ungrouped(t: mx.array) -> mx.array:
    """(B, G, H / G, ...) -> (B, H, ...)."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


@mx.compile  # one fused kernel: the T x T exponentials dominate a chunk's cost on the CPU
def pairwise_decay(within: mx.array) -> mx.array:
    """(..., T) log decays summed from the chunk's start -> (..., T, T): entry [i, j] is
    exp(within_i - within_j), the decay from position j to i, for j <= i; 0 above the
    diagonal. A difference of running totals (not a T x T cumulative sum, slow on the CPU):
    within one chunk the totals stay small enough for float32."""
    T = within.shape[-1]
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    return mx.where(causal, mx.exp(mx.where(causal, within[..., :, None] - within[..., None, :], -mx.inf)), 0.0)


def chunk_scan(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
               state: mx.array) -> tuple[mx.array, mx.array]:
    """One chunk: x (B, T, H, P), dt (B, T, H), A (H,), B and C (B, T, G, N), state
    (B, H, P, N) at the chunk's start -> (y (B, T, H, P), the state after the chunk)."""
    G = B.shape[2]
    log_decay = mx.swapaxes(dt * A, 1, 2)  # (B, H, T)
    within = mx.cumsum(log_decay, axis=-1)  # (B, H, T): log decay from the chunk's start to t
    xdt = mx.swapaxes(x * dt[..., None], 1, 2)  # (B, H, T, P)
    Bg, Cg = mx.swapaxes(B, 1, 2), mx.swapaxes(C, 1, 2)  # (B, G, T, N)
    scores = (Cg @ mx.swapaxes(Bg, -1, -2))[:, :, None]  # (B, G, 1, T, T): C_i . B_j
    weights = scores * grouped(pairwise_decay(within), G)  # (B, G, H/G, T, T)
    y = ungrouped(weights @ grouped(xdt, G))  # (B, H, T, P): inside the chunk
    # the start state read by every position, decayed to it
    from_state = ungrouped(Cg[:, :, None] @ mx.swapaxes(grouped(state, G), -1, -2))  # (B, H, T, P)
    y = y + from_state * mx.exp(within)[..., None]
    # the state after the chunk: the start state decayed through it plus each position's
    # input decayed from t to the chunk's end
    to_end = mx.exp(within[..., -1:] - within)  # (B, H, T)
    inputs = ungrouped(mx.swapaxes(grouped(xdt * to_end[..., None], G), -1, -2) @ Bg[:, :, None])  # (B, H, P, N)
    new_state = state * mx.exp(within[..., -1])[..., None, None] + inputs
    return mx.swapaxes(y, 1, 2), new_state


def working_chunk(chunk_size: int) -> int:
    """The positions per chunk the scan runs: ``chunk_size``, at most ``CPU_CHUNK`` on the CPU."""
    return min(chunk_size, CPU_CHUNK) if on_cpu() else chunk_size


def ssd_chunked(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array, chunk_size: int,
                state: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The chunked form over a whole prompt: x (B, L, H, P), dt (B, L, H) (already
    softplus'd and clipped), A (H,) (negative), B and C (B, L, G, N), ``state`` (B, H, P, N)
    or None (zeros) -> (y (B, L, H, P) without the D skip, the final state); chunks of
    ``working_chunk(chunk_size)`` positions."""
    batch, length, heads, head_dim = x.shape
    chunk_size = working_chunk(chunk_size)
    if state is None:
        state = mx.zeros((batch, heads, head_dim, B.shape[-1]), dtype=mx.float32)
    x, dt, B, C = (t.astype(mx.float32) for t in (x, dt, B, C))
    A = A.astype(mx.float32)
    ys = []
    for start in range(0, length, chunk_size):
        piece = slice(start, start + chunk_size)
        y, state = chunk_scan(x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], state)
        ys.append(y)
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), state


def ssd_step(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
             state: mx.array | None) -> tuple[mx.array, mx.array]:
    """The recurrent form for one position: x (B, H, P), dt (B, H), A (H,), B and C
    (B, G, N), state (B, H, P, N) or None (zeros) -> (y (B, H, P), the new state)."""
    batch, heads, head_dim = x.shape
    G, N = B.shape[1:]
    if state is None:
        state = mx.zeros((batch, heads, head_dim, N), dtype=mx.float32)
    x, dt, B, C = (t.astype(mx.float32) for t in (x, dt, B, C))
    decay = mx.exp(dt * A.astype(mx.float32))[..., None, None]  # (B, H, 1, 1)
    xdt = grouped((x * dt[..., None])[..., None], G)  # (B, G, H/G, P, 1)
    state = state * decay + ungrouped(xdt * B[:, :, None, None, :])  # (B, H, P, N)
    y = ungrouped(grouped(state, G) @ C[:, :, None, :, None])  # (B, H, P, 1)
    return y[..., 0], state


def ssd_scan(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array, chunk_size: int,
             state: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """The SSD scan, (B, L, ...) in and out: one position with a state to continue from
    takes the step form, anything else the chunked form."""
    if x.shape[1] == 1 and state is not None:
        y, state = ssd_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state)
        return y[:, None], state
    return ssd_chunked(x, dt, A, B, C, chunk_size, state)
