"""Llama 4's attention pieces: chunked local attention, the L2 q/k norm and the attention
temperature of the layers without positions.

- ``chunked_attention`` layers split the sequence into chunks of ``attention_chunk_size``
  positions; a query sees the keys of its own chunk up to itself, nothing before the
  chunk's start (unlike a sliding window, the span shrinks back to one at every chunk
  start).
- The rotating layers normalise each head of q and k to unit RMS, with no learned weight.
- The layers without RoPE (NoPE, global) multiply their queries by
  ``log1p(floor((position + 1) / floor_scale)) * attn_scale + 1``, which grows with the
  position so that attention stays sharp over long contexts.

Shapes: B batch, L new positions, S cached positions.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError
from .positions import position_ids


def chunk_mask(query_positions: mx.array, key_positions: mx.array, chunk: int) -> mx.array:
    """Boolean mask (L, S): query i sees key j when j is not in its future and both lie in
    the same chunk of ``chunk`` positions."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    return (k <= q) & (k // chunk == q // chunk)


def chunked_mask(offset, length: int, chunk: int) -> mx.array | str | None:
    """The mask of ``length`` new queries after ``offset`` cached positions, over a cache
    that holds every position from 0 (``KVCache``): chunked, or plain causal while every
    position so far lies in the first chunk. One offset for every row only: batched
    caches go through ``chunked_cache.layer_chunked_mask``."""
    if not isinstance(offset, int):
        raise UserError("chunked attention (Llama 4) is not supported with batched caches")
    if offset + length <= chunk:
        return "causal" if length > 1 else None
    return chunk_mask(mx.arange(offset, offset + length), mx.arange(offset + length), chunk)


def l2_norm(x: mx.array, eps: float) -> mx.array:
    """x scaled to unit RMS over its last axis: an RMSNorm without a weight."""
    return mx.fast.rms_norm(x, None, eps)


def temperature_scales(offset, length: int, floor_scale: float, attn_scale: float) -> mx.array:
    """The queries' factor at each new position, shaped to broadcast against queries
    (B, n_heads, L, head_dim): (L, 1) after a scalar offset, (B, 1, L, 1) after one per row."""
    positions = position_ids(offset, length).astype(mx.float32)  # (L,) or (B, L)
    scales = mx.log1p(mx.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0
    return scales[:, None, :, None] if scales.ndim == 2 else scales[:, None]
