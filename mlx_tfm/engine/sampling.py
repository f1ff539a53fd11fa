"""Choosing the next token for every row of a batch at once, each row with its own
settings and its own random stream.

The settings are arrays (B,), so one compiled function serves any mix of values (a new
temperature does not compile a new kernel); only which filters any row uses picks the
function. The filters and their order are ``mlx_tfm.generation.sampling``'s: top-k, top-p, min-p on the
untempered log-probabilities, then a draw at the row's temperature; temperature 0 is
greedy. The draw is Gumbel-max with noise from the row's own key, which advances once
per token: a seeded row gives the same tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx

from ..generation.sampling import NEG_INF, apply_min_p, apply_top_p


@dataclass(frozen=True)
class RowSettings:
    """One row's sampler settings (validated by the caller)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits


class BatchSettings:
    """The settings of B rows as arrays, built once per batch composition."""

    def __init__(self, rows: list[RowSettings]):
        self.temps = mx.array([r.temp for r in rows], mx.float32)
        # top_p 0 or 1 disables the filter (as make_sampler): a bound no mass reaches
        self.top_ps = mx.array([r.top_p if 0 < r.top_p < 1 else 2.0 for r in rows], mx.float32)
        self.top_ks = mx.array([r.top_k for r in rows], mx.int32)
        self.min_ps = mx.array([r.min_p for r in rows], mx.float32)
        sampled = [r for r in rows if r.temp > 0]
        self.filters = (any(r.top_k > 0 for r in sampled), any(0 < r.top_p < 1 for r in sampled),
                        any(r.min_p > 0 for r in sampled))
        self.any_sampled = bool(sampled)
        # every row's logit bias as one scatter-add: (row, token id, bias) triples
        triples = [(b, token, bias) for b, r in enumerate(rows) for token, bias in r.logit_bias]
        self.bias = None
        if triples:
            rows_of, ids, values = zip(*triples)
            self.bias = (mx.array(rows_of, mx.int32), mx.array(ids, mx.int32), mx.array(values, mx.float32))


def add_logit_bias(logits: mx.array, settings: BatchSettings) -> mx.array:
    """Logits (B, V) with each row's logit bias added (one operation for the batch, so a
    biased row needs no per-row processing)."""
    if settings.bias is None:
        return logits
    rows, ids, values = settings.bias
    return logits.at[rows, ids].add(values.astype(logits.dtype))


def apply_top_k_rows(logprobs: mx.array, top_ks: mx.array) -> mx.array:
    """Keep each row's ``top_ks[b]`` most probable tokens (0: all). Ties at the k-th
    value are all kept."""
    descending = -mx.sort(-logprobs, axis=-1)  # (B, V)
    kth = mx.take_along_axis(descending, mx.maximum(top_ks - 1, 0)[:, None], axis=-1)  # (B, 1)
    threshold = mx.where(top_ks[:, None] > 0, kth, NEG_INF)
    return mx.where(logprobs >= threshold, logprobs, NEG_INF)


@lru_cache(maxsize=None)
def row_sampler(use_top_k: bool, use_top_p: bool, use_min_p: bool):
    """``(logprobs (B, V), temps, top_ps, top_ks, min_ps, keys (B, 2)) -> (tokens (B,),
    next keys (B, 2))``, compiled once for this choice of filters."""

    def sample(logprobs, temps, top_ps, top_ks, min_ps, keys):
        filtered = logprobs
        if use_top_k:
            filtered = apply_top_k_rows(filtered, top_ks)
        if use_top_p:
            filtered = apply_top_p(filtered, top_ps[:, None])
        if use_min_p:
            filtered = apply_min_p(filtered, min_ps[:, None])
        pairs = mx.vmap(mx.random.split)(keys)  # (B, 2, 2): the next key, this token's key
        vocab = logprobs.shape[-1]
        noise = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(pairs[:, 1])  # (B, V)
        sampled = filtered / mx.maximum(temps, 1e-6)[:, None] + noise
        scores = mx.where(temps[:, None] > 0, sampled, logprobs)
        return mx.argmax(scores, axis=-1), pairs[:, 0]

    return mx.compile(sample)


def sample_rows(logprobs: mx.array, settings: BatchSettings, keys: mx.array) -> tuple[mx.array, mx.array]:
    """Tokens (B,) for log-probabilities (B, V), and every row's advanced key (B, 2)."""
    if not settings.any_sampled:
        return mx.argmax(logprobs, axis=-1), keys
    sampler = row_sampler(*settings.filters)
    return sampler(logprobs.astype(mx.float32), settings.temps, settings.top_ps, settings.top_ks,
                   settings.min_ps, keys)


def top_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest log-probabilities of each row and their token ids, (B, k) each,
    most probable first."""
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)


__all__ = ["RowSettings", "BatchSettings", "add_logit_bias", "sample_rows", "top_logprobs", "apply_top_k_rows"]
