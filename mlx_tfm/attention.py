"""Scaled dot-product attention: the one function the model calls.

Shapes: queries (B, n_heads, L, head_dim); keys and values (B, n_kv_heads, S, head_dim),
the KV heads never repeated (GQA and MQA broadcast them). ``mask`` is None, ``"causal"``
(the last L of S positions, as the fused op aligns it), a boolean array (True = may
attend), an additive float array, broadcastable to (B, n_heads, L, S), or ``CausalRows``
(causal over a batch's rows that start at different slots: mlx_tfm's CPU kernel takes it
in its two parts, every other route as the array it stands for).

Keys and values from a ``QuantizedKVCache`` come as ``QuantizedKV`` (packed numbers, scales
and biases); attention then multiplies by them with ``mx.quantized_matmul`` and never makes
a dequantized copy of the cache.
"""

from __future__ import annotations

import mlx.core as mx

from .cache import CausalRows, QuantizedKV, window_mask
from .cpu import on_cpu
from .cpu.attention import QUERY_BLOCK, attention_by_query_blocks, kernel_attention, kernel_takes
from .cpu import quantized_attention as cpu_quantized
from .cpu.quantized_attention import in_float32


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
    weights = grouped_weights(scores, mask, cap)
    return (weights @ values).reshape(B, n_heads, L, -1)


def grouped_weights(scores: mx.array, mask, cap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """Softmax weights from grouped scores (B, n_kv_heads, n_rep, L, S): soft-capped,
    masked, and with a per-head sink logit (n_heads,) sharing the mass when given."""
    B, n_kv_heads, n_rep, L, S = scores.shape
    if cap:
        scores = mx.tanh(scores / cap) * cap
    if isinstance(mask, str):
        mask = window_mask(mx.arange(S - L, S), mx.arange(S), None)
    if mask is not None:
        if mask.ndim == 4:  # (B or 1, n_heads or 1, L, S) -> grouped like the scores
            b, h, *rest = mask.shape
            mask = mask.reshape(b, 1, 1, *rest) if h == 1 else mask.reshape(b, n_kv_heads, n_rep, *rest)
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_ else scores + mask
    if sinks is None:
        return mx.softmax(scores, axis=-1, precise=True)
    sink = mx.broadcast_to(sinks.astype(scores.dtype).reshape(1, n_kv_heads, n_rep, 1, 1), (B, n_kv_heads, n_rep, L, 1))
    return mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)[..., 1:]


def quantized_attention(queries, keys: QuantizedKV, values: QuantizedKV, scale: float, mask,
                        cap: float | None = None, sinks: mx.array | None = None, scores_of=None) -> mx.array:
    """Attention over quantized keys and values: the scores are the product of the queries
    with the packed keys (``scores_of``, or ``quantized_scores``), the output that of the
    weights with the packed values, both ``mx.quantized_matmul``. GQA groups the queries as
    ``softcapped_attention`` does."""
    B, n_heads, L, head_dim = queries.shape
    n_kv_heads = keys.data.shape[1]
    queries = (queries * scale).reshape(B, n_kv_heads, n_heads // n_kv_heads, L, head_dim)
    scores = (scores_of or quantized_scores)(queries, keys)  # (B, n_kv_heads, n_rep, L, S)
    weights = grouped_weights(scores, mask, cap, sinks)
    out = quantized_weighted_values(weights, values)  # (B, n_kv_heads, n_rep, L, head_dim)
    return out.reshape(B, n_heads, L, head_dim)


def quantized_scores(queries: mx.array, keys: QuantizedKV) -> mx.array:
    """Grouped queries (B, n_kv_heads, n_rep, L, head_dim) times the packed keys, which
    broadcast over each KV head's n_rep query heads as (B, n_kv_heads, 1, S, packed)."""
    grouped_keys = [a[:, :, None] for a in keys.arrays]
    return mx.quantized_matmul(queries, *grouped_keys, transpose=True, group_size=keys.group_size, bits=keys.bits)


def quantized_weighted_values(weights: mx.array, values: QuantizedKV) -> mx.array:
    """Weights (B, n_kv_heads, n_rep, L, S) times the packed values -> (..., L, head_dim)."""
    grouped_values = [a[:, :, None] for a in values.arrays]
    return mx.quantized_matmul(weights, *grouped_values, transpose=False, group_size=values.group_size,
                               bits=values.bits)


def attention(queries, keys, values, scale: float, mask=None, softcap: float | None = None,
              sinks: mx.array | None = None) -> mx.array:
    """Attention of ``queries`` over ``keys``/``values`` -> (B, n_heads, L, head_dim).

    ``sinks`` (n_heads,): gpt-oss's per-head logit that joins every softmax and takes its
    share of the mass without a value. Quantized keys and values (``QuantizedKV``) and
    soft-capped scores take their own paths (no fused kernel has them; on the CPU the
    quantized path computes in float32, its scores on every core:
    ``mlx_tfm/cpu/quantized_attention.py``);
    on the CPU mlx_tfm's kernel takes what it can (``cpu.attention.kernel_takes``), and
    else a chunk of more than ``QUERY_BLOCK`` queries goes a block at a time (less memory,
    the same numbers); everything else is ``mx.fast.scaled_dot_product_attention``."""
    if isinstance(mask, CausalRows):
        if on_cpu() and not isinstance(keys, QuantizedKV) and not softcap and kernel_takes(queries, mask.rows, sinks):
            return kernel_attention(queries, keys, values, scale, mask.rows, causal=True)
        mask = mask.array(queries.shape[2])
    if isinstance(keys, QuantizedKV):
        if on_cpu():
            scores_of = cpu_quantized.scores if cpu_quantized.kernel_takes(queries, keys) else None
            out = quantized_attention(*in_float32(queries, keys, values), scale, mask, softcap, sinks, scores_of)
            return out.astype(queries.dtype)
        return quantized_attention(queries, keys, values, scale, mask, softcap, sinks)
    if softcap:
        if sinks is not None:
            raise ValueError("attention sinks with soft-capped scores are not supported")
        return softcapped_attention(queries, keys, values, scale, mask, softcap)
    if on_cpu() and kernel_takes(queries, mask, sinks):
        return kernel_attention(queries, keys, values, scale, mask)
    if on_cpu() and queries.shape[2] > QUERY_BLOCK:
        return attention_by_query_blocks(queries, keys, values, scale, mask, QUERY_BLOCK, sinks)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
