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
import mlx.nn as nn

from ..cpu import linear as cpu_linear
from ..cpu import on_cpu
from ..cpu import quantized_attention as cpu_quantized
from ..cpu.attention import (
    QUERY_BLOCK,
    attention_by_query_blocks,
    kernel_attention,
    kernel_takes,
)
from ..cpu.quantized_attention import in_float32
from .cache import CausalRows, CrossAttentionCache, QuantizedKV, window_mask
from .config import ModelArgs
from .kv_sharing import SharedKV, first_shared_layer
from .layers import RMSNorm
from .local_attention import l2_norm, temperature_scales
from .mrope import ExplicitPositions, make_mrope
from .positions import make_rope, position_ids


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


def query_position_scale(offset, length: int, beta: float, period: int) -> mx.array:
    """Ministral 3's query temperature, ``1 + beta * log(1 + floor(position / period))``:
    (L, 1) after a scalar offset, (B, 1, L, 1) after per-row offsets, to scale queries
    (B, n_heads, L, head_dim)."""
    positions = position_ids(offset, length).astype(mx.float32)  # (L,) or (B, L)
    scale = 1 + beta * mx.log(1 + mx.floor(positions / period))
    return scale[:, None] if scale.ndim == 1 else scale[:, None, :, None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        D = args.hidden_size
        self.n_heads = args.num_attention_heads
        # Gemma 4: full-attention layers may have their own head size and KV heads
        full = args.layer_types[layer_idx] == "full_attention"
        self.n_kv_heads = args.num_global_key_value_heads if full and args.num_global_key_value_heads \
            else args.num_key_value_heads
        self.head_dim = args.global_head_dim if full and args.global_head_dim else args.head_dim
        self.scale = args.attention_scale
        self.softcap = args.attn_logit_softcapping
        self.output_gate = args.attn_output_gate
        self.keys_are_values = args.attention_k_eq_v and full  # Gemma 4: values from k_proj too
        self.value_norm_eps = args.norm_eps if args.value_norm else None
        # KV-shared layers (kv_sharing.py) attend with another layer's keys and values
        self.reads_shared_kv = layer_idx >= first_shared_layer(args)
        q_rows = self.n_heads * self.head_dim * (2 if self.output_gate else 1)  # gated: each head's gate too
        self.q_proj = nn.Linear(D, q_rows, bias=args.attention_bias)
        if not self.reads_shared_kv:
            self.k_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        if not (self.reads_shared_kv or self.keys_are_values):
            self.v_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, D, bias=args.attention_out_bias)
        if args.attention_sinks:
            self.sinks = mx.zeros((self.n_heads,))
        self.clip_qkv = args.clip_qkv
        # q/k norm over each head (Qwen 3, Gemma 3) or over the whole projection (OLMo 2)
        self.qk_norm_scope = args.qk_norm_scope if args.qk_norm else None
        if self.qk_norm_scope not in (None, "head", "projection"):
            raise ValueError(f"unknown qk_norm_scope {args.qk_norm_scope!r} (head, projection)")
        if args.qk_norm:
            per_head = self.qk_norm_scope == "head"
            q_dims = self.head_dim if per_head else self.n_heads * self.head_dim
            k_dims = self.head_dim if per_head else self.n_kv_heads * self.head_dim
            self.q_norm = RMSNorm(q_dims, args.norm_eps, args.norm_weight_offset)
            if not self.reads_shared_kv:
                self.k_norm = RMSNorm(k_dims, args.norm_eps, args.norm_weight_offset)
        rotates = args.position_embedding == "rope" and (not args.rope_layers or args.rope_layers[layer_idx])
        # Qwen2-VL's M-RoPE (rope_scaling of type "mrope") takes (t, h, w) positions per token
        self.rope = (make_mrope(args, self.head_dim) or make_rope(args, args.layer_types[layer_idx], self.head_dim)
                     if rotates else None)
        # Llama 4: an L2 q/k norm on the rotating layers, a temperature on the others
        self.l2_eps = args.norm_eps if args.qk_l2_norm and rotates else None
        self.temperature = (args.floor_scale, args.attn_scale) if args.attn_temperature_tuning and not rotates else None
        self.query_scale = (args.query_position_scale_beta, args.query_position_scale_period)
        if args.qk_norm_after_rope and self.qk_norm_scope != "head":
            raise ValueError("qk_norm_after_rope needs qk_norm over each head")
        self.qk_norm_after_rope = args.qk_norm_after_rope

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if isinstance(cache, CrossAttentionCache):
            return self._cross_attention(x, cache)
        if isinstance(cache, SharedKV):
            return self._shared_kv_attention(x, mask, cache)
        positions = None
        if isinstance(cache, ExplicitPositions):  # M-RoPE: the tokens' (3, B, L) positions
            cache, positions = cache.cache, cache.positions
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        where = offset if positions is None else positions  # what the rotary turns by
        gate = None
        if self.output_gate:
            queries, keys, values, gate = self._gated_heads(x, where)
        else:
            # M-RoPE's explicit positions take the unfused route; else one position may fuse
            queries, keys, values = self.heads(x, offset) if positions is None else self._heads(x, where)
        if self.query_scale[0]:
            queries = queries * query_position_scale(offset, L, *self.query_scale).astype(queries.dtype)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = attention(queries, keys, values, self.scale, mask, self.softcap, self.get("sinks"))
        return self.output(out, gate)

    def heads(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """The part of a call before the cache (ungated attention): queries, keys and values
        (B, heads, L, head_dim) of x (B, L, D), rotated to their positions from ``offset``;
        one position through the CPU kernels' fused route where it takes the layer."""
        ready = self._decoding_heads(x, offset) if x.shape[1] == 1 else None
        return ready or self._heads(x, offset)

    def output(self, out: mx.array, gate: mx.array | None = None) -> mx.array:
        """The part after attention: its output (B, n_heads, L, head_dim), gated where the
        layer has an output gate, through ``o_proj`` -> (B, L, D)."""
        B, _, L, _ = out.shape
        # (B, n_heads, L, head_dim) -> (B, L, n_heads * head_dim)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out if gate is None else out * mx.sigmoid(gate))

    def _gated_heads(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Qwen3-Next's gated attention: q_proj emits each head's queries then its output
        gate; ``_heads``' results plus the gate (B, L, n_heads * head_dim)."""
        B, L, _ = x.shape
        # (B, L, n_heads * 2 * head_dim) -> (B, L, n_heads, 2 * head_dim): queries, gate
        queries, gate = mx.split(self.q_proj(x).reshape(B, L, self.n_heads, 2 * self.head_dim), 2, axis=-1)
        queries = queries.reshape(B, L, -1)
        heads = self._shaped_heads(queries, self.k_proj(x), self.v_proj(x), offset)
        return (*heads, gate.reshape(B, L, -1))

    def _decoding_heads(self, x: mx.array, offset) -> list[mx.array] | None:
        """``_heads`` for one position in one call of the CPU kernels (products, layout and
        RoPE together), where they take it and nothing comes between the products and RoPE
        (clipping, q/k norms, YaRN's scaling); else None."""
        if self.clip_qkv is not None or self.qk_norm_scope is not None or self.keys_are_values \
                or self.value_norm_eps is not None:
            return None
        if self.l2_eps is not None or self.temperature is not None:
            return None
        rope = self.rope
        if rope is not None and rope.attention_factor != 1.0:
            return None
        settings = None if rope is None else (offset, rope.periods, rope.dims, rope.traditional, rope.scale)
        return cpu_linear.fused_products((self.q_proj, self.k_proj, self.v_proj), x,
                                         heads=(self.n_heads, self.n_kv_heads, self.n_kv_heads), rope=settings)

    def _heads(self, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values (B, heads, L, head_dim), queries and keys rotated to
        their positions (from ``offset``)."""
        return self._shaped_heads(*self._projections(x), offset)

    def _shaped_heads(self, queries, keys, values, offset) -> tuple[mx.array, mx.array, mx.array]:
        """Projected (B, L, heads * head_dim) -> clipped, normed, (B, heads, L, head_dim), rotated."""
        B, L, _ = queries.shape
        if self.clip_qkv is not None:
            queries, keys, values = (mx.clip(t, -self.clip_qkv, self.clip_qkv) for t in (queries, keys, values))
        if self.qk_norm_scope == "projection":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        # (B, L, n_heads * head_dim) -> (B, L, n_heads, head_dim)
        queries = queries.reshape(B, L, self.n_heads, self.head_dim)
        keys = keys.reshape(B, L, self.n_kv_heads, self.head_dim)
        values = values.reshape(B, L, self.n_kv_heads, self.head_dim)
        if self.qk_norm_scope == "head" and not self.qk_norm_after_rope:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.value_norm_eps is not None:  # Gemma 4: RMS norm of each value head, no scale
            values = mx.fast.rms_norm(values, None, self.value_norm_eps)
        # -> (B, heads, L, head_dim), the layout attention and the cache work in
        queries, keys, values = (t.transpose(0, 2, 1, 3) for t in (queries, keys, values))
        if self.rope is not None:
            queries, keys = self.rope(queries, offset), self.rope(keys, offset)
        if self.l2_eps is not None:  # after RoPE, as Llama 4 (a rotation keeps the norm anyway)
            queries, keys = l2_norm(queries, self.l2_eps), l2_norm(keys, self.l2_eps)
        if self.temperature is not None:
            queries = queries * temperature_scales(offset, L, *self.temperature).astype(queries.dtype)
        if self.qk_norm_after_rope:  # HunYuan
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        return queries, keys, values

    def _projections(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k and v projections of x (B, L, D); with ``keys_are_values`` the values are
        the keys' projection (before the keys' norm and rotation)."""
        if self.keys_are_values:
            projected = cpu_linear.fused_products((self.q_proj, self.k_proj), x)
            queries, keys = projected or (self.q_proj(x), self.k_proj(x))
            return queries, keys, keys
        projected = cpu_linear.fused_products((self.q_proj, self.k_proj, self.v_proj), x)
        return projected or (self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def _shared_kv_attention(self, x: mx.array, mask, shared: SharedKV) -> mx.array:
        """A KV-shared layer: its own queries over the keys and values its source layer
        fetched in this forward pass (kv_sharing.py)."""
        B, L, _ = x.shape
        queries = self.q_proj(x)
        if self.qk_norm_scope == "projection":
            queries = self.q_norm(queries)
        queries = queries.reshape(B, L, self.n_heads, self.head_dim)  # (B, L, n_heads, head_dim)
        if self.qk_norm_scope == "head":
            queries = self.q_norm(queries)
        queries = queries.transpose(0, 2, 1, 3)  # (B, n_heads, L, head_dim)
        if self.rope is not None:
            queries = self.rope(queries, shared.offset)
        keys, values = shared.fetch()
        out = attention(queries, keys, values, self.scale, mask, self.softcap, self.get("sinks"))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _cross_attention(self, x: mx.array, cross: CrossAttentionCache) -> mx.array:
        """Queries from the decoder's ``x``, keys and values from the encoder's output,
        projected once per input (``CrossAttentionCache``); no positions, no causal mask."""
        B, L, _ = x.shape
        # (B, L, n_heads * head_dim) -> (B, n_heads, L, head_dim)
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        keys, values = cross.fetch(self._project_memory)
        out = attention(queries, keys, values, self.scale, cross.mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _project_memory(self, memory: mx.array) -> tuple[mx.array, mx.array]:
        B, S, _ = memory.shape
        # (B, S, n_kv_heads * head_dim) -> (B, n_kv_heads, S, head_dim)
        keys = self.k_proj(memory).reshape(B, S, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        values = self.v_proj(memory).reshape(B, S, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return keys, values
