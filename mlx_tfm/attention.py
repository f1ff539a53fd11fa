"""Scaled dot-product attention: the one function the model calls.

Shapes: queries (B, n_heads, L, head_dim); keys and values (B, n_kv_heads, S, head_dim),
the KV heads never repeated (GQA and MQA broadcast them). ``mask`` is None, ``"causal"``
(the last L of S positions, as the fused op aligns it), a boolean array (True = may
attend) or an additive float array, broadcastable to (B, n_heads, L, S).
"""

from __future__ import annotations

import mlx.core as mx

from .cache import window_mask
from .cpu import on_cpu
from .cpu.attention import QUERY_BLOCK, attention_by_query_blocks


def softcapped_attention(queries, keys, values, scale: float, mask, cap: float) -> mx.array:
    """Attention with tanh soft-capped scores (Gemma 2), which the fused kernel lacks.

    GQA without repeating KV heads: queries are grouped (B, n_kv_heads, n_rep, L, head_dim)
    and broadcast against keys (B, n_kv_heads, 1, S, head_dim).
    """
    B, n_heads, L, head_dim = queries.shape
    n_kv_heads, S = keys.shape[1], keys.shape[2]
    queries = queries.reshape(B, n_kv_heads, n_heads // n_kv_heads, L, head_dim)
    keys, values = keys[:, :, None], values[:, :, None]
    scores = (queries * scale) @ keys.swapaxes(-1, -2)  # (B, n_kv_heads, n_rep, L, S)
    scores = mx.tanh(scores / cap) * cap
    if isinstance(mask, str):
        mask = window_mask(mx.arange(S - L, S), mx.arange(S), None)
    if mask is not None:
        if mask.ndim == 4:  # (B or 1, n_heads or 1, L, S) -> grouped like the scores
            b, h, *rest = mask.shape
            mask = mask.reshape(b, 1, 1, *rest) if h == 1 else mask.reshape(b, n_kv_heads, n_heads // n_kv_heads, *rest)
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(B, n_heads, L, -1)


def attention(queries, keys, values, scale: float, mask=None, softcap: float | None = None) -> mx.array:
    """Attention of ``queries`` over ``keys``/``values`` -> (B, n_heads, L, head_dim).

    Soft-capped scores take their own path (no fused kernel has them); on the CPU a chunk
    of more than ``QUERY_BLOCK`` queries goes a block at a time (less memory, the same
    numbers); everything else is ``mx.fast.scaled_dot_product_attention``."""
    if softcap:
        return softcapped_attention(queries, keys, values, scale, mask, softcap)
    if on_cpu() and queries.shape[2] > QUERY_BLOCK:
        return attention_by_query_blocks(queries, keys, values, scale, mask, QUERY_BLOCK)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
