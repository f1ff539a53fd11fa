"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash).

Each position is compressed into one small latent shared by every head:

    latent, k_pe = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    latent = kv_a_layernorm(latent)                       # (B, 1, L, R)
    k_nope_h = latent @ W_k[h],  v_h = latent @ W_v[h]    # kv_b_proj, split per head

and only the normed latent and the rotated ``k_pe`` (one rotary key for all heads) are
cached: a ``KVCache`` holds them as keys (B, 1, S, R) and values (B, 1, S, P), so every
cache kind (batched, rotating, prompt caches, quantized) works unchanged on them. The
queries go through ``q_a_proj -> q_a_layernorm -> q_b_proj`` (or a plain ``q_proj``) and
split per head into a part without positions and a rotated part (``qk_rope_head_dim``).

Two forms compute the same attention:
- *expanded* (prompts): each head's keys and values are made from the cached latents,
  then ordinary attention, ``concat(q_nope, q_pe) . concat(k_nope, k_pe)``;
- *absorbed* (decoding): ``q_nope . (latent W_k)`` is ``(q_nope W_k^T) . latent``, so
  the query is folded into latent space (``embed_q``), attention runs over the latents
  themselves, and ``W_v`` is applied once to the weighted sum (``unembed_out``): no
  per-head keys or values are made. A quantized cache is read as it is packed
  (``mx.quantized_matmul``); a prompt chunk over one dequantizes the latents (one head,
  R wide) for the expanded form, which costs less than the absorbed one for many queries.

``kv_b_proj`` is kept as mlx-lm keeps it, split per head: ``embed_q.weight`` (H, R, nope)
and ``unembed_out.weight`` (H, v_head_dim, R) (``HeadLinear``), quantized along their last
axis like any linear layer. DeepSeek's YaRN scales the rotated dims (``RoPE``) and, by
``mscale_all_dim``, the softmax (``latent_softmax_scale``).

Shapes: B batch, L new positions, S cached positions, H heads, R ``kv_lora_rank``,
P ``qk_rope_head_dim``.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..cpu import linear as cpu_linear
from ..cpu import on_cpu
from ..errors import UserError
from .attention import attention
from .cache import CausalRows, KVQuantization, QuantizedKV, QuantizedKVCache, window_mask
from .config import ModelArgs
from .layers import RMSNorm
from .positions import RoPE, rope_type

# DeepSeek's q_a_layernorm and kv_a_layernorm keep transformers' default epsilon, whatever
# the config's rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def unrotated(x: mx.array, offset) -> mx.array:
    """The rotation of a model without positions: none."""
    return x


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def latent_softmax_scale(head_dim: int, scaling: dict | None) -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor, mscale_all_dim)^2
    under a RoPE scaling that sets ``mscale_all_dim`` (DeepSeek's YaRN)."""
    scale = head_dim**-0.5
    if rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


class HeadLinear(nn.Module):
    """One (output_dims, input_dims) matrix per head, stored (H, out, in): ``x @ W^T``, or
    with ``transpose=False`` ``x @ W`` (from out back to in)."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        bound = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-bound, bound, (num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return x @ (self["weight"].swapaxes(-1, -2) if transpose else self["weight"])

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedHeadLinear":
        return QuantizedHeadLinear(self.weight, group_size, bits, mode)


class QuantizedHeadLinear(nn.Module):
    """``HeadLinear`` with each head's matrix quantized along its input axis."""

    def __init__(self, weight: mx.array, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:  # affine only
            self.biases = biases[0]
        self.freeze()

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        if on_cpu() and not cpu_linear.few_rows(x.shape[-2]):  # a prompt's latents
            return cpu_linear.dequantized_head_product(x, self, transpose)
        return mx.quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), transpose=transpose,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)


def visible(mask, length: int, slots: int):
    """Any mask ``attention`` takes -> None, a boolean or an additive array
    broadcastable to (B, H, L, S)."""
    if isinstance(mask, CausalRows):
        return mask.array(length)
    if isinstance(mask, str):
        return window_mask(mx.arange(slots - length, slots), mx.arange(slots), None)
    return mask


def masked(scores: mx.array, mask) -> mx.array:
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


def check_latent_quantization(quantization: KVQuantization, widths: tuple[int, int]) -> None:
    """One-line ``UserError`` when the latents or rotary keys cannot be quantized in groups."""
    for width in widths:
        group = quantization.group_for(width)
        if group is None or width % group:
            raise UserError(f"--kv-bits: this model caches {widths[0]}-wide latents and {widths[1]}-wide rotary "
                            f"keys, which groups of {group or '32, 64 or 128'} do not divide")


class LatentAttention(nn.Module):
    """DeepSeek's MLA as a token mixer: ``(x (B, L, D), mask, cache) -> (B, L, D)``."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        D, H = args.hidden_size, args.num_attention_heads
        self.n_heads = H
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim, self.latent_dim = args.v_head_dim, args.kv_lora_rank
        q_width = H * (self.nope_dim + self.rope_dim)
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(D, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(D, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.latent_dim + self.rope_dim, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, LATENT_NORM_EPS)
        self.embed_q = HeadLinear(self.nope_dim, self.latent_dim, H)  # W_k^T: nope -> latent
        self.unembed_out = HeadLinear(self.latent_dim, self.v_dim, H)  # W_v: latent -> v_head_dim
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=args.attention_out_bias)
        # Kimi Linear's MLA keeps the rope-sized key part but rotates nothing (position_embedding "none")
        self.rope = RoPE(self.rope_dim, args.rope_traditional, args.rope_theta, args.rope_scaling,
                         args.max_position_embeddings) if args.position_embedding == "rope" else unrotated
        self.scale = latent_softmax_scale(self.nope_dim + self.rope_dim, args.rope_scaling)

    def __call__(self, x: mx.array, mask=None, cache=None, absorbed: bool | None = None) -> mx.array:
        """``absorbed``: None picks the absorbed form for one new position, the expanded
        one otherwise; True / False force it (both compute the same)."""
        B, L, _ = x.shape
        if isinstance(cache, QuantizedKVCache):
            check_latent_quantization(cache.quantization, (self.latent_dim, self.rope_dim))
        offset = cache.offset if cache is not None else 0
        q_nope, q_pe = self._queries(x, offset)
        latent, k_pe = self._latents(x, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        if absorbed is None:
            absorbed = L == 1
        if absorbed:
            out = self._absorbed(q_nope, q_pe, latent, k_pe, mask)
        else:
            if isinstance(latent, QuantizedKV):
                latent, k_pe = latent.dequantize(), k_pe.dequantize()
            out = self._expanded(q_nope, q_pe, latent, k_pe, mask)
        # (B, H, L, v_head_dim) -> (B, L, H * v_head_dim)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _queries(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """(B, H, L, nope) and the rotated (B, H, L, P)."""
        B, L, _ = x.shape
        if "q_proj" in self:
            queries = self.q_proj(x)
        else:
            queries = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # (B, L, H * (nope + P)) -> (B, H, L, nope + P)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(queries, [self.nope_dim], axis=-1)
        return q_nope, self.rope(q_pe, offset)

    def _latents(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """What the cache keeps of each position: the normed latent (B, 1, L, R) and the
        rotated key (B, 1, L, P)."""
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.latent_dim], axis=-1)
        # (B, L, R) and (B, L, P) -> one shared "head": (B, 1, L, R), (B, 1, L, P)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), 1)
        return latent, self.rope(mx.expand_dims(k_pe, 1), offset)

    def _expanded(self, q_nope, q_pe, latent, k_pe, mask) -> mx.array:
        """Per-head keys (B, H, S, nope + P) and values (B, H, S, v) from the latents, then
        ``attention`` (its fused kernels and every mask kind)."""
        B, H, S = latent.shape[0], self.n_heads, latent.shape[2]
        k_nope = self.embed_q(latent, transpose=False)  # (B, 1, S, R) @ (H, R, nope) -> (B, H, S, nope)
        values = self.unembed_out(latent)  # (B, H, S, v)
        keys = mx.concatenate([k_nope, mx.broadcast_to(k_pe, (B, H, S, self.rope_dim))], axis=-1)
        queries = mx.concatenate([q_nope, q_pe], axis=-1)
        # the fused kernels want one width for queries, keys and values: zeros widen the
        # narrower side without changing a score or an output
        width = max(queries.shape[-1], self.v_dim)
        queries, keys, values = (widened(t, width) for t in (queries, keys, values))
        return attention(queries, keys, values, self.scale, mask)[..., : self.v_dim]

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask) -> mx.array:
        """Attention in latent space: scores ``(q_nope W_k^T) . latent + q_pe . k_pe``, the
        weighted sum of latents, then ``W_v``. Reads a ``QuantizedKV`` cache as it is.

        Every head's queries are rows of one product against the shared latents: as a
        broadcast over heads, (B, H, L, R) @ (B, 1, R, S) is one product per head, each
        reading the whole cache again (H times the memory traffic of one)."""
        B, H, L = q_nope.shape[:3]
        S = cached_length(k_pe)

        def as_rows(t: mx.array) -> mx.array:  # (B, H, L, d) -> (B, 1, H * L, d)
            return t.reshape(B, 1, H * L, t.shape[-1])

        q_latent = self.embed_q(q_nope) * self.scale  # (B, H, L, R)
        scores = times_keys(as_rows(q_latent), latent) + times_keys(as_rows(q_pe * self.scale), k_pe)
        scores = scores.reshape(B, H, L, S)  # (B, 1, H * L, S) -> (B, H, L, S)
        weights = mx.softmax(masked(scores, visible(mask, L, S)), axis=-1, precise=True)
        summed = weights_times(as_rows(weights), latent).reshape(B, H, L, -1)  # (B, 1, H * L, R) -> (B, H, L, R)
        return self.unembed_out(summed)


def widened(x: mx.array, width: int) -> mx.array:
    """``x`` with zeros appended along its last axis up to ``width``."""
    extra = width - x.shape[-1]
    return x if extra == 0 else mx.concatenate([x, mx.zeros((*x.shape[:-1], extra), x.dtype)], axis=-1)


def cached_length(keys) -> int:
    return (keys.data if isinstance(keys, QuantizedKV) else keys).shape[2]


def times_keys(queries: mx.array, keys) -> mx.array:
    """(B, H, L, d) against one shared key head (B, 1, S, d), float or quantized -> (B, H, L, S)."""
    if isinstance(keys, QuantizedKV):
        return mx.quantized_matmul(queries.astype(keys.scales.dtype), *keys.arrays, transpose=True,
                                   group_size=keys.group_size, bits=keys.bits)
    return queries @ keys.swapaxes(-1, -2)


def weights_times(weights: mx.array, values) -> mx.array:
    """Softmax weights (B, H, L, S) times one shared value head (B, 1, S, d) -> (B, H, L, d)."""
    if isinstance(values, QuantizedKV):
        return mx.quantized_matmul(weights.astype(values.scales.dtype), *values.arrays, transpose=False,
                                   group_size=values.group_size, bits=values.bits)
    return weights.astype(values.dtype) @ values


__all__ = ["LatentAttention", "HeadLinear", "QuantizedHeadLinear", "latent_softmax_scale"]
