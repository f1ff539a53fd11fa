"""``BatchStateCache``: the batched cache of a recurrent layer (one whose single-sequence
cache is a ``StateCache``: short convolutions, linear attention, Mamba).

Each of the layer's state arrays holds the B rows stacked on axis 0, and ``offset`` (B,)
counts the positions each row has folded in. A state has the same size at every
position, so rows at different positions stack without alignment; but it folds in every
input it reads, so a padded position could not be taken back: ``takes_padding`` is
False and the scheduler feeds such batches chunks that no row pads. A row at position 0
has no state yet; where it joins rows that have one, its arrays are zeros, which is the
state every recurrent layer starts from.

It is also what the layer's mixer is called with: ``cache[i]`` reads and writes state
array i of all rows, ``advance(L)`` moves every row on by L.

``BatchParallelCache`` batches Falcon-H1's ``ParallelCache`` (attention and a Mamba-2
mixer side by side in one layer) as a ``BatchKVCache`` beside a ``BatchStateCache``.
"""

from __future__ import annotations

import mlx.core as mx

from ..model.cache import KVCache
from ..model.mamba import ParallelCache
from ..model.state_cache import StateCache
from .batch_cache import BatchCache, BatchKVCache, batch_cache_for, register_batch_cache


class BatchStateCache(BatchCache):
    """``n_arrays`` state arrays (B, ...) of B rows, and each row's ``offset`` (B,)."""

    takes_padding = False

    def __init__(self, n_arrays: int):
        self.arrays: list[mx.array | None] = [None] * n_arrays
        self.offset = mx.zeros((0,), mx.int32)  # (B,)

    def __getitem__(self, index: int) -> mx.array | None:
        return self.arrays[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.arrays[index] = value

    def advance(self, length: int) -> None:
        self.offset = self.offset + length

    @property
    def size(self) -> int:
        return self.offset.shape[0]

    def make_mask(self, length: int, window: int | None = None):
        return None  # read in order: causal by construction

    def row_from(self, single: StateCache | None, length: int) -> "BatchStateCache | None":
        """A state holds exactly the positions it has folded in: only ``length`` equal to
        its offset can be given (a shorter prefix would need a snapshot taken there)."""
        row = BatchStateCache(len(self.arrays))
        row.offset = mx.array([length], mx.int32)
        if single is None or length == 0:
            return row if length == 0 else None
        if single.offset != length or len(single.arrays) != len(self.arrays):
            return None
        row.arrays = [None if a is None else mx.array(a) for a in single.arrays]  # the entry stays as it is
        return row

    def select(self, rows: list[int]) -> "BatchStateCache":
        chosen = BatchStateCache(len(self.arrays))
        if not rows:
            return chosen
        index = mx.array(rows)
        chosen.offset = self.offset[index]
        chosen.arrays = [None if a is None else a[index] for a in self.arrays]  # (len(rows), ...)
        return chosen

    def extend(self, *others: "BatchStateCache") -> None:
        parts = [cache for cache in (self, *others) if cache.size]
        if not parts:
            return
        for j in range(len(self.arrays)):
            like = next((c.arrays[j] for c in parts if c.arrays[j] is not None), None)
            if like is None:
                self.arrays[j] = None  # no row has written this array yet
                continue
            row_shape = like.shape[1:]
            # rows with no state yet start from zeros, the initial state
            stacked = [c.arrays[j] if c.arrays[j] is not None else mx.zeros((c.size, *row_shape), like.dtype)
                       for c in parts]
            self.arrays[j] = mx.concatenate(stacked)  # (B, ...)
        self.offset = mx.concatenate([c.offset for c in parts])

    def drop_padding(self, pads: list[int]) -> None:
        if any(pads):
            raise ValueError("a recurrent layer's rows are never padded (takes_padding is False)")

    def holds_all(self, row: int, length: int) -> bool:
        return int(self.offset[row].item()) == length

    def export_row(self, row: int, into: StateCache) -> None:
        into.arrays = [None if a is None else mx.contiguous(a[row : row + 1]) for a in self.arrays]  # (1, ...)
        into.offset = int(self.offset[row].item())

    @property
    def state(self) -> tuple:
        return tuple(a for a in self.arrays if a is not None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


class BatchParallelCache(BatchCache):
    """The batched ``ParallelCache`` (Falcon-H1: attention with a Mamba-2 mixer beside it in
    one layer): a ``BatchKVCache`` and a ``BatchStateCache`` over the same B rows, which
    the block hands to its two mixers as ``attention`` and ``mamba``. Positions and masks
    are the attention's; the state beside it folds in every input, so, as any recurrent
    layer, it is never padded (``takes_padding`` False)."""

    takes_padding = False

    def __init__(self, attention: BatchKVCache, mamba: BatchStateCache):
        self.attention, self.mamba = attention, mamba

    @property
    def offset(self) -> mx.array:
        return self.attention.offset

    @property
    def size(self) -> int:
        return self.attention.size

    def make_mask(self, length: int, window: int | None = None):
        return self.attention.make_mask(length, window)

    def row_from(self, single: ParallelCache | None, length: int) -> "BatchParallelCache | None":
        attention = self.attention.row_from(None if single is None else single.attention, length)
        mamba = self.mamba.row_from(None if single is None else single.mamba, length)
        return None if attention is None or mamba is None else BatchParallelCache(attention, mamba)

    def select(self, rows: list[int]) -> "BatchParallelCache":
        return BatchParallelCache(self.attention.select(rows), self.mamba.select(rows))

    def extend(self, *others: "BatchParallelCache") -> None:
        self.attention.extend(*(other.attention for other in others))
        self.mamba.extend(*(other.mamba for other in others))

    def drop_padding(self, pads: list[int]) -> None:
        self.mamba.drop_padding(pads)  # refuses any padding: the state cannot give it back

    def holds_all(self, row: int, length: int) -> bool:
        return self.attention.holds_all(row, length) and self.mamba.holds_all(row, length)

    def export_row(self, row: int, into: ParallelCache) -> None:
        self.attention.export_row(row, into.attention)
        self.mamba.export_row(row, into.mamba)

    @property
    def state(self) -> tuple:
        return (*self.attention.state, *self.mamba.state)

    @property
    def nbytes(self) -> int:
        return self.attention.nbytes + self.mamba.nbytes


def row_states(caches: list[BatchCache], row: int) -> dict[int, StateCache | ParallelCache]:
    """Row ``row``'s recurrent layers (layer index -> its state as a single-sequence
    ``StateCache``, or a ``ParallelCache`` with the attention beside it): a snapshot of
    them where the row is now."""
    states = {}
    for i, layer in enumerate(caches):
        if isinstance(layer, BatchStateCache):
            states[i] = StateCache(len(layer.arrays))
        elif isinstance(layer, BatchParallelCache):
            states[i] = ParallelCache(KVCache(), StateCache(len(layer.mamba.arrays)))
        else:
            continue
        layer.export_row(row, states[i])
    return states


def batch_parallel_cache(layer: ParallelCache) -> BatchParallelCache:
    return BatchParallelCache(batch_cache_for(layer.attention), batch_cache_for(layer.mamba))


register_batch_cache(StateCache, lambda layer: BatchStateCache(len(layer.arrays)))
register_batch_cache(ParallelCache, batch_parallel_cache)


__all__ = ["BatchStateCache", "BatchParallelCache", "row_states"]
