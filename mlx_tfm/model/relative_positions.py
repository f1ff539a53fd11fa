"""T5's relative position bias: a learned scalar per head for each bucket of key - query
distance, added to the attention scores of every layer of a stack (computed once, in the
first layer's table, and shared by the others).

Buckets, as Mesh TensorFlow and transformers draw them: half of them hold the small
distances one by one, the other half grow logarithmically up to ``max_distance``, past
which every distance shares the last bucket. Bidirectional stacks (the encoder) give keys
after the query their own half of the buckets; causal stacks (the decoder) only look back.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np


def relative_position_bucket(relative: np.ndarray, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> np.ndarray:
    """The bucket of each ``relative`` = key position - query position (int array).

    Computed in float32 in transformers' order of operations, so the boundaries between
    logarithmic buckets fall where theirs do."""
    relative = np.asarray(relative, dtype=np.int64)
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).astype(np.int64) * num_buckets
        distance = np.abs(relative)
    else:
        distance = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    with np.errstate(divide="ignore"):
        scaled = (np.log(distance.astype(np.float32) / np.float32(max_exact))
                  / np.float32(math.log(max_distance / max_exact)) * np.float32(num_buckets - max_exact))
    large = max_exact + np.where(is_small, 0, scaled).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(is_small, distance, large)


@lru_cache(maxsize=64)
def _bucket_table(bidirectional: bool, num_buckets: int, max_distance: int, span: int) -> np.ndarray:
    """Buckets of every relative position in [-span, span], index = relative + span."""
    return relative_position_bucket(np.arange(-span, span + 1), bidirectional, num_buckets, max_distance)


def relative_position_bias(table: mx.array, query_positions: range, key_length: int, bidirectional: bool,
                           max_distance: int) -> mx.array:
    """The bias (1, n_heads, L, S) of queries at ``query_positions`` over keys 0..S-1.

    ``table`` (num_buckets, n_heads): the learned bias per bucket. A decoding step's query
    sits at the cache's offset, so its row is the one a full recomputation would have there."""
    num_buckets = table.shape[0]
    span = max(key_length, query_positions.stop)
    buckets = _bucket_table(bidirectional, num_buckets, max_distance, _round_up(span))
    queries = np.arange(query_positions.start, query_positions.stop)[:, None]
    relative = np.arange(key_length)[None, :] - queries  # (L, S)
    index = mx.array(buckets[relative + _round_up(span)].astype(np.int32))
    return table[index].transpose(2, 0, 1)[None]  # (L, S, n_heads) -> (1, n_heads, L, S)


def _round_up(n: int, step: int = 256) -> int:
    """Spans in steps, so one cached table serves a whole decoding run."""
    return ((n + step - 1) // step) * step


__all__ = ["relative_position_bucket", "relative_position_bias"]
