"""A sliding-window layer's batched cache drops the slots no new query can see when it
grows; the masks, made before that update, must count the slots as it leaves them: the
mask of every update spans exactly the keys the update returns, and a query sees the
positions of its window in its own row and no other (growing in steps of 4 slots over a
window of 8, rows at different positions)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_tfm.engine.batch_cache import BatchKVCache
from mlx_tfm.model.cache import CausalRows, window_mask

WINDOW = 8


def dense(mask, rows: int, length: int, slots: int) -> np.ndarray:
    """Any mask ``make_mask`` returns as booleans (rows, 1, L, S)."""
    if isinstance(mask, CausalRows):
        mask = mask.array(length)
    elif mask is None or mask == "causal":  # the fused kernel's own: causal, the queries last
        mask = window_mask(mx.arange(slots - length, slots), mx.arange(slots), None)
    return np.broadcast_to(np.array(mask), (rows, 1, length, slots))


def positions_seen(mask: np.ndarray, keys: np.ndarray, row: int, query: int) -> list[int]:
    """The positions (stored as the keys' values) that ``query`` of ``row`` sees."""
    return sorted(int(k) for k, seen in zip(keys[row, 0, :, 0], mask[row, 0, query]) if seen)


def test_every_mask_spans_the_keys_its_update_returns_and_sees_the_window():
    offsets = [5, 2]
    rows = [BatchKVCache.for_row(mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1),
                                 mx.zeros((1, 1, n, 1)), n, WINDOW) for n in offsets]
    cache = rows[0]
    cache.step = 4  # grow (and drop) every few positions
    cache.extend(rows[1])
    for length in [3, 1, 1, 4, 1, 2, 1, 1, 5, 1, 1, 1]:
        positions = np.array(cache.offset)[:, None] + np.arange(length)  # (B, L) each row's new positions
        mask = cache.make_mask(length)
        new_keys = mx.array(positions, mx.float32)[:, None, :, None]  # (B, 1, L, 1) a key holds its position
        keys, _ = cache.update_and_fetch(new_keys, mx.zeros_like(new_keys))
        mask = dense(mask, 2, length, keys.shape[2])
        for row in range(2):
            for query in range(length):
                p = int(positions[row, query])
                assert positions_seen(mask, np.array(keys), row, query) == list(range(max(0, p - WINDOW + 1), p + 1))
    assert cache.keys.shape[2] < 3 * WINDOW  # it dropped as it grew
