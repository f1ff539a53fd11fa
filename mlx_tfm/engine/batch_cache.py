"""``BatchKVCache``: one layer's keys and values for B rows that sit at different positions,
so that one forward pass serves requests that started at different times.

Rows are right-aligned: slot ``used - 1`` holds every row's newest position, and row b's
data fills slots ``[starts[b], used)``; the slots before ``starts[b]`` belong to no
position of that row and are masked out. ``offset`` (B,) is each row's next position,
which RoPE and learned or sinusoidal positions read per row. Because the rows end
together, "the last ``window`` positions" are the same slots for every row: a sliding
window (or ``--max-kv-size``) is one bound on the slots kept, and memory stays bounded.

A chunk of L new tokens per row is appended to every row at once (decoding: L = 1); a
row with fewer tokens to feed pads its chunk at the end, and ``drop_padding`` then moves
those slots in front of its data. Rows join with ``extend`` and leave with ``select``.
"""

from __future__ import annotations

import mlx.core as mx

from ..model.cache import CausalRows, RotatingKVCache


class BatchKVCache:
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

    def _grow(self, keys: mx.array, values: mx.array, length: int) -> None:
        if self.window is not None:
            self._drop_before(self.used - (self.window - 1))  # what no new query can see
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

    def make_mask(self, length: int, window: int | None = None):
        """Mask for ``length`` new queries per row: causal, within the window, and never
        on a row's empty slots. None or "causal" when the rows are aligned; when they
        differ, (B, 1, 1, S) for one query, ``CausalRows`` for a chunk without a window,
        else (B, 1, L, S)."""
        windows = [w for w in (window, self.window) if w is not None]
        window = min(windows) if windows else None
        total = self.used + length
        aligned = not any(self.starts)
        if aligned and (window is None or total <= window):
            return "causal" if length > 1 else None
        queries = mx.arange(self.used, total)[:, None]  # (L, 1) slots of the new tokens
        slots = mx.arange(total)[None]  # (1, S)
        visible = slots <= queries
        if window is not None:
            visible = visible & (queries - slots < window)
        if aligned:
            return visible
        starts = mx.array(self.starts)[:, None, None]  # (B, 1, 1)
        if window is None and length > 1:
            return CausalRows((slots[None] >= starts)[:, None])  # rows (B, 1, 1, S)
        return (visible[None] & (slots[None] >= starts))[:, None]  # (B, 1, L, S)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- rows joining and leaving ------------------------------------------------------------
    def select(self, rows: list[int]) -> "BatchKVCache":
        """A new cache of the given rows (in that order), without the slots none of them uses."""
        chosen = BatchKVCache(self.window)
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


def layer_windows(model, max_kv_size: int | None) -> list[int | None]:
    """Per layer, how many positions it attends to (None: all), as ``model.make_cache``
    bounds them: a sliding window, ``max_kv_size``, or the smaller of the two."""
    windows = []
    for layer_cache in model.make_cache(max_kv_size=max_kv_size):
        if isinstance(layer_cache, RotatingKVCache):
            if layer_cache.keep:
                raise ValueError("a batched cache cannot keep the first positions of a rotating cache")
            windows.append(layer_cache.max_size)
        else:
            windows.append(None)
    return windows


def empty_batch(windows: list[int | None]) -> list[BatchKVCache]:
    return [BatchKVCache(window) for window in windows]


def single_row_caches(model, max_kv_size: int | None, states: list[tuple[mx.array, mx.array]],
                      length: int) -> list:
    """``model.make_cache`` layers holding one row's ``states`` (every layer its full
    history of ``length`` positions), for the shared prompt cache."""
    layers = model.make_cache(max_kv_size=max_kv_size)
    for layer, (keys, values) in zip(layers, states):
        if keys.shape[2] != length:
            raise ValueError(f"a layer holds {keys.shape[2]} of the {length} positions")
        if length:
            layer.reserve(length)
            layer.update_and_fetch(keys, values)
    return layers


__all__ = ["BatchKVCache", "layer_windows", "empty_batch", "single_row_caches"]
