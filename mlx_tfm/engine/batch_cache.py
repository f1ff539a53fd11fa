"""The batched per-layer cache: ``BatchCache``, the one interface the engine uses, and
``BatchKVCache``, its implementation for attention's keys and values.

Every layer of a batch has one ``BatchCache`` holding its B rows, which sit at different
positions so that one forward pass serves requests that started at different times. The
engine admits rows from single-sequence caches (``row_from``), joins them (``extend``),
drops finished ones (``select``), undoes a prefill chunk's padding (``drop_padding``) and
hands a finished row back as a single-sequence cache (``holds_all``, ``export_row``);
nothing else. Which implementation serves a layer is chosen from the kind of its
single-sequence cache (``model.make_cache``) by ``batch_cache_for``; a new layer kind (a
recurrent one, say, with a fixed-size state) registers its own with
``register_batch_cache``, and the engine needs no change.

``BatchKVCache``: rows are right-aligned. Slot ``used - 1`` holds every row's newest
position, and row b's data fills slots ``[starts[b], used)``; the slots before
``starts[b]`` belong to no position of that row and are masked out. ``offset`` (B,) is
each row's next position, which RoPE and learned or sinusoidal positions read per row.
Because the rows end together, "the last ``window`` positions" are the same slots for
every row: a sliding window (or ``--max-kv-size``) is one bound on the slots kept, and
memory stays bounded. A chunk of L new tokens per row is appended to every row at once
(decoding: L = 1); a row with fewer tokens to feed pads its chunk at the end, and
``drop_padding`` then moves those slots in front of its data. Llama 4's chunked-attention
layers ask ``make_mask(L, chunk=...)``: each row's chunks are counted from its own
position 0, read from its offset (slot s of row b holds position ``offset[b] - used + s``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import mlx.core as mx

from ..errors import UserError
from ..model.cache import CausalRows, KVCache, RotatingKVCache


class BatchCache(ABC):
    """One layer's cache for the B rows of a batch: what the engine asks of it.

    The model's forward pass uses it as any cache of its layer kind: it reads ``offset``
    (B,), each row's next position, and ``make_mask``, and calls what the layer computes
    with (attention: ``update_and_fetch``). Row i is the same request in every layer."""

    offset: mx.array  # (B,) each row's next position
    # Whether ``drop_padding`` can take back positions a padded chunk fed: false for a
    # state that folds every input in (a recurrent layer); its rows are then never padded.
    takes_padding: bool = True

    @property
    @abstractmethod
    def size(self) -> int:
        """Rows in the batch."""

    @abstractmethod
    def make_mask(self, length: int, window: int | None = None):
        """The mask of ``length`` new queries per row (the model's forward pass asks)."""

    @abstractmethod
    def row_from(self, single, length: int) -> "BatchCache | None":
        """A new cache of this kind and settings with one row: the first ``length``
        positions of the single-sequence cache ``single`` (None, with ``length`` 0: a row
        at position 0); None when ``single`` cannot give those positions."""

    @abstractmethod
    def select(self, rows: list[int]) -> "BatchCache":
        """A new cache of the given rows in that order (none: an empty one of this kind)."""

    @abstractmethod
    def extend(self, *others: "BatchCache") -> None:
        """Append the rows of ``others`` (caches of this kind) after these."""

    @abstractmethod
    def drop_padding(self, pads: list[int]) -> None:
        """After a chunk whose last ``pads[b]`` tokens of row b were padding: forget them,
        so that row b's next position is its own again."""

    @abstractmethod
    def holds_all(self, row: int, length: int) -> bool:
        """Whether ``row`` holds all its ``length`` positions, so that ``export_row`` can
        hand it back whole."""

    @abstractmethod
    def export_row(self, row: int, into) -> None:
        """Write ``row``'s positions into ``into``, an empty single-sequence cache of this
        layer (from ``model.make_cache``)."""

    @property
    @abstractmethod
    def state(self) -> tuple:
        """The arrays that hold the rows (to evaluate them)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the rows take."""


class BatchKVCache(BatchCache):
    """Keys and values (B, n_kv_heads, capacity, head_dim) of B right-aligned rows; a
    ``window`` keeps (and attends to) only the last positions (see the module docstring)."""

    step = 256

    def __init__(self, window: int | None = None):
        self.window = window  # attend to (and keep) only the last `window` positions
        self.keys: mx.array | None = None  # (B, n_kv_heads, capacity, head_dim)
        self.values: mx.array | None = None
        self.used = 0
        self.starts: list[int] = []
        self.offset = mx.zeros((0,), mx.int32)  # (B,)

    @classmethod
    def for_row(cls, keys: mx.array | None, values: mx.array | None, offset: int,
                window: int | None) -> "BatchKVCache":
        """One row at position ``offset`` whose cache holds ``keys``/``values`` (1,
        n_kv_heads, n, head_dim): its last n positions, or nothing (None)."""
        cache = cls(window)
        cache.starts = [0]
        cache.offset = mx.array([offset], mx.int32)
        if keys is not None and keys.shape[2] > 0:
            cache.keys, cache.values, cache.used = keys, values, keys.shape[2]
        return cache

    @classmethod
    def for_rotating(cls, layer: RotatingKVCache) -> "BatchKVCache":
        """The batched cache of a layer whose single-sequence cache is ``layer``: its bound
        is the window; the first positions a rotating cache may keep have no batched form."""
        if layer.keep:
            raise ValueError("a batched cache cannot keep the first positions of a rotating cache")
        return cls(layer.max_size)

    def row_from(self, single, length: int) -> "BatchKVCache | None":
        keys = values = None
        if single is not None and length:
            keys, values = single.state  # (1, n_kv_heads, n, head_dim), positions 0..n-1 unless it rotated
            if keys.shape[2] != single.offset or length > single.offset:
                return None
            keys, values = keys[..., :length, :], values[..., :length, :]  # views: the entry stays as it is
        return BatchKVCache.for_row(keys, values, length, self.window)

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return len(self.starts)

    def row_length(self, row: int) -> int:
        """How many positions row ``row`` holds (fewer than its offset once a window drops
        old ones)."""
        return self.used - self.starts[row]

    # -- the cache protocol the model calls ------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, n_kv_heads, L, head_dim)`` to every row; return all slots in use."""
        length = keys.shape[2]
        if self.keys is None or self.used + length > self.keys.shape[2]:
            self._grow(keys, values, length)
        self.keys[..., self.used : self.used + length, :] = keys
        self.values[..., self.used : self.used + length, :] = values
        self.used += length
        self.offset = self.offset + length
        return self.keys[..., : self.used, :], self.values[..., : self.used, :]

    def drop_padding(self, pads: list[int]) -> None:
        """After a chunk in which row b's last ``pads[b]`` tokens were padding: move those
        slots in front of the row's data (among its empty slots) and take its offset back
        by as much, so every row still ends at slot ``used - 1``. A copy of the padded
        rows' own slots: far cheaper than another forward pass for their shorter chunks."""
        if not any(pads):
            return
        self.offset = self.offset - mx.array(pads, mx.int32)
        for row, pad in enumerate(pads):
            if pad == 0:
                continue
            start = self.starts[row]
            for cache in (self.keys, self.values):  # (B, n_kv_heads, capacity, head_dim)
                cache[row : row + 1, :, start + pad : self.used] = cache[row : row + 1, :, start : self.used - pad]
            self.starts[row] = start + pad

    def _dropped_by(self, length: int) -> int:
        """How many of the oldest slots the update of ``length`` new positions drops: with
        a window, when it grows the buffer, those no new query can see."""
        if self.window is None or self.keys is None or self.used + length <= self.keys.shape[2]:
            return 0
        return max(0, self.used - (self.window - 1))

    def _slots_seen(self, length: int) -> tuple[int, list[int]]:
        """``used`` and ``starts`` as the update of ``length`` new positions finds them once
        it has dropped what it drops: the masks, made before it, count slots so."""
        drop = self._dropped_by(length)
        return self.used - drop, [max(0, start - drop) for start in self.starts]

    def _grow(self, keys: mx.array, values: mx.array, length: int) -> None:
        self._drop_before(self._dropped_by(length))  # what no new query can see
        B, n_kv_heads, _, k_head_dim = keys.shape
        n_new = -(-length // self.step) * self.step
        new_keys = mx.zeros((B, n_kv_heads, n_new, k_head_dim), keys.dtype)
        new_values = mx.zeros((B, n_kv_heads, n_new, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_keys, new_values
        else:
            self.keys = mx.concatenate([self.keys[..., : self.used, :], new_keys], axis=2)
            self.values = mx.concatenate([self.values[..., : self.used, :], new_values], axis=2)

    def _drop_before(self, slot: int) -> None:
        if slot <= 0 or self.keys is None:
            return
        self.keys, self.values = self.keys[..., slot : self.used, :], self.values[..., slot : self.used, :]
        self.used -= slot
        self.starts = [max(0, start - slot) for start in self.starts]

    def make_mask(self, length: int, window: int | None = None, chunk: int | None = None):
        """Mask for ``length`` new queries per row: causal, within the window, and never
        on a row's empty slots. None or "causal" when the rows are aligned; when they
        differ, (B, 1, 1, S) for one query, ``CausalRows`` for a chunk without a window,
        else (B, 1, L, S). With ``chunk`` (Llama 4's chunked attention), see
        ``chunked_mask``."""
        if chunk is not None:
            return self.chunked_mask(length, chunk)
        windows = [w for w in (window, self.window) if w is not None]
        window = min(windows) if windows else None
        used, starts = self._slots_seen(length)
        total = used + length
        aligned = not any(starts)
        if aligned and (window is None or total <= window):
            return "causal" if length > 1 else None
        queries = mx.arange(used, total)[:, None]  # (L, 1) slots of the new tokens
        slots = mx.arange(total)[None]  # (1, S)
        visible = slots <= queries
        if window is not None:
            visible = visible & (queries - slots < window)
        if aligned:
            return visible
        starts = mx.array(starts)[:, None, None]  # (B, 1, 1)
        if window is None and length > 1:
            return CausalRows((slots[None] >= starts)[:, None])  # rows (B, 1, 1, S)
        return (visible[None] & (slots[None] >= starts))[:, None]  # (B, 1, L, S)

    def chunked_mask(self, length: int, chunk: int) -> mx.array:
        """(B, 1, L, S) for ``length`` new queries of a chunked-attention layer: a query
        sees its own row's keys up to itself in the same chunk of ``chunk`` positions,
        the chunks counted from each row's own position 0 (slot s of row b holds position
        ``offset[b] - used + s``: the rows end together)."""
        used, starts = self._slots_seen(length)
        total = used + length
        slots = mx.arange(total)
        keys = self.offset[:, None] - used + slots[None]  # (B, S) each slot's position in its row
        queries = self.offset[:, None] + mx.arange(length)[None]  # (B, L)
        keys, queries = keys[:, None, :], queries[:, :, None]  # (B, 1, S), (B, L, 1)
        visible = (keys <= queries) & (keys // chunk == queries // chunk)
        visible = visible & (slots >= mx.array(starts)[:, None])[:, None, :]  # never a row's empty slots
        if self.window is not None:
            visible = visible & (queries - keys < self.window)
        return visible[:, None]  # (B, 1, L, S)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- rows joining and leaving ------------------------------------------------------------
    def select(self, rows: list[int]) -> "BatchKVCache":
        """A new cache of the given rows (in that order), without the slots none of them uses."""
        chosen = type(self)(self.window)  # a subclass (chunked layers) stays itself
        if not rows:
            return chosen
        index = mx.array(rows)
        chosen.offset = self.offset[index]
        starts = [self.starts[i] for i in rows]
        if self.keys is None:
            chosen.starts = starts
            return chosen
        shift = min(starts)
        chosen.keys = self.keys[index, :, shift:]  # (len(rows), n_kv_heads, capacity - shift, head_dim)
        chosen.values = self.values[index, :, shift:]
        chosen.used = self.used - shift
        chosen.starts = [start - shift for start in starts]
        return chosen

    def extend(self, *others: "BatchKVCache") -> None:
        """Append the rows of ``others`` after these, right-aligning them all: one copy of
        every row however many caches join (joining one at a time would copy the rows
        already here again for each)."""
        parts = [cache for cache in (self, *others) if cache.size]
        if len(parts) <= 1:
            if parts and parts[0] is not self:
                only = parts[0]
                self.keys, self.values, self.used = only.keys, only.values, only.used
                self.starts, self.offset = list(only.starts), only.offset
            return
        used = max(cache.used for cache in parts)
        template = next(((c.keys, c.values) for c in parts if c.keys is not None), None)
        if template is not None:
            capacity = used + self.step
            aligned = [cache._aligned(used, capacity, *template) for cache in parts]
            self.keys = mx.concatenate([keys for keys, _ in aligned])
            self.values = mx.concatenate([values for _, values in aligned])
        self.starts = [s + used - cache.used for cache in parts for s in cache.starts]
        self.offset = mx.concatenate([cache.offset for cache in parts])
        self.used = used

    def _aligned(self, used: int, capacity: int, keys_like: mx.array, values_like: mx.array):
        """Keys and values with ``used`` slots in use (ours ending at its end) and
        ``capacity`` slots in all; zeros shaped like the templates when we hold none."""
        if self.keys is None:
            return tuple(mx.zeros((self.size, like.shape[1], capacity, like.shape[3]), like.dtype)
                         for like in (keys_like, values_like))
        before, after = used - self.used, capacity - used
        pad = [(0, 0), (0, 0), (before, after), (0, 0)]
        return (mx.pad(self.keys[..., : self.used, :], pad), mx.pad(self.values[..., : self.used, :], pad))

    def row_state(self, row: int) -> tuple[mx.array, mx.array]:
        """Row ``row``'s keys and values (1, n_kv_heads, n, head_dim), in their own memory."""
        start = self.starts[row]
        return (mx.contiguous(self.keys[row : row + 1, :, start : self.used]),
                mx.contiguous(self.values[row : row + 1, :, start : self.used]))

    def holds_all(self, row: int, length: int) -> bool:
        # a row as long as the window may have dropped its oldest position already
        return self.row_length(row) == length and (self.window is None or length < self.window)

    def export_row(self, row: int, into) -> None:
        length = self.row_length(row)
        if length:
            into.reserve(length)
            into.update_and_fetch(*self.row_state(row))

    @property
    def state(self) -> tuple:
        return () if self.keys is None else (self.keys, self.values)


# -- which batched cache serves which layer ----------------------------------------------------

BatchCacheMaker = Callable[[object], BatchCache]  # a layer's single-sequence cache -> its empty batched one
BATCH_CACHES: dict[type, BatchCacheMaker] = {}


def register_batch_cache(single_kind: type, make: BatchCacheMaker) -> None:
    """Serve the layers whose single-sequence cache (from ``model.make_cache``) is a
    ``single_kind`` with the batched caches ``make`` returns."""
    BATCH_CACHES[single_kind] = make


def batch_cache_for(layer) -> BatchCache:
    """An empty batched cache for the layer whose single-sequence cache is ``layer``."""
    make = BATCH_CACHES.get(type(layer))
    if make is None:
        raise UserError(f"the batching engine has no batched cache for layers whose cache is {type(layer).__name__}")
    return make(layer)


def batch_caches(model, max_kv_size: int | None) -> list[BatchCache]:
    """One empty batched cache per layer of ``model``, as ``model.make_cache`` bounds them."""
    return [batch_cache_for(layer) for layer in model.make_cache(max_kv_size=max_kv_size)]


def layer_windows(model, max_kv_size: int | None) -> list[int | None]:
    """Per layer, how many positions its ``BatchKVCache`` attends to (None: all): a
    sliding window, ``max_kv_size``, or the smaller of the two."""
    return [cache.window for cache in batch_caches(model, max_kv_size)]


register_batch_cache(KVCache, lambda layer: BatchKVCache())
register_batch_cache(RotatingKVCache, BatchKVCache.for_rotating)


__all__ = ["BatchCache", "BatchKVCache", "register_batch_cache", "batch_cache_for", "batch_caches", "layer_windows"]
