"""The cache of Llama 4's chunked-attention layers, bounded by about one chunk.

A ``chunked_attention`` layer's query sees only the keys of its own chunk of
``attention_chunk_size`` positions (local_attention.py), so once a chunk is over its keys
are never read again. ``ChunkedKVCache`` drops them: when new tokens arrive, the positions
before the chunk of the first new one go. Between updates it holds positions ``start ..
offset - 1`` with ``start`` the first position of the chunk the last update began in, so
after single-token steps it holds at most one chunk (after an update of L tokens at most
``chunk + L - 1`` positions, until the next update).

Keeping the last update's first chunk is what lets trimming take that update back
(speculative decoding's rejected guesses cross chunk boundaries too). Trimming works back
to ``start``; further back would need a chunk that was dropped, which is a ``UserError``.

``Model.make_cache`` gives chunked layers a ``KVCache`` (every position from 0, which
``--kv-bits`` can quantize); ``chunk_bound.chunk_bounded`` swaps those for
``ChunkedKVCache``s where a generation or the batching engine makes its caches.

Shapes: B batch, L new positions, S positions the new queries attend over.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError
from .cache import KVCache
from .local_attention import chunk_mask, chunked_mask


class ChunkedKVCache:
    """Keys and values (B, n_kv_heads, capacity, head_dim) whose slot s holds position
    ``start + s``; slots ``offset - start`` and beyond are free room."""

    step = 256

    def __init__(self, chunk: int):
        if chunk < 1:
            raise ValueError(f"a chunked cache needs a chunk of at least 1 position, got {chunk}")
        self.chunk = chunk
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.start = 0  # the position slot 0 holds

    def chunk_start(self, position: int) -> int:
        """The first position of the chunk that holds ``position``."""
        return position - position % self.chunk

    def reserve(self, positions: int) -> None:
        """As ``KVCache.reserve``; nothing to do: the buffer grows to about a chunk only."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, n_kv_heads, L, head_dim)`` keys/values; return the keys the new
        queries attend over: positions ``chunk_start(offset) .. offset + L - 1``."""
        self._drop_before(self.chunk_start(self.offset))
        held, length = self.offset - self.start, keys.shape[2]
        if self.keys is None or held + length > self.keys.shape[2]:
            self._grow(keys, values, held + length)
        self.keys[..., held : held + length, :] = keys
        self.values[..., held : held + length, :] = values
        self.offset += length
        return self.keys[..., : held + length, :], self.values[..., : held + length, :]

    def _drop_before(self, position: int) -> None:
        """Forget the positions before ``position`` (earlier chunks'): once per chunk."""
        if position <= self.start:
            return
        if self.keys is not None:
            drop, held = position - self.start, self.offset - self.start
            self.keys, self.values = self.keys[..., drop:held, :], self.values[..., drop:held, :]
        self.start = position

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        """Room for ``needed`` slots, in steps of ``step``; the held slots copied over."""
        B, n_kv_heads, _, k_head_dim = keys.shape
        capacity = -(-needed // self.step) * self.step
        new_keys = mx.zeros((B, n_kv_heads, capacity, k_head_dim), keys.dtype)
        new_values = mx.zeros((B, n_kv_heads, capacity, values.shape[3]), values.dtype)
        held = self.offset - self.start
        if self.keys is not None and held:
            new_keys[..., :held, :] = self.keys[..., :held, :]
            new_values[..., :held, :] = self.values[..., :held, :]
        self.keys, self.values = new_keys, new_values

    def make_mask(self, length: int, window: int | None = None, chunk: int | None = None):
        """The mask of ``length`` new queries over the keys ``update_and_fetch`` returns:
        causal while they all lie in one chunk (``"causal"``: the fused kernel builds it),
        else (L, S) chunked."""
        first = self.chunk_start(self.offset)
        if self.offset + length <= first + self.chunk:
            return "causal" if length > 1 else None
        queries = mx.arange(self.offset, self.offset + length)
        return chunk_mask(queries, mx.arange(first, self.offset + length), self.chunk)

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        """Whether the last ``n`` positions can be forgotten: not past the held ones."""
        return self.offset - min(n, self.offset) >= self.start

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions; back to ``start`` at most."""
        n = min(self.offset, n)
        if not self.can_trim(n):
            raise UserError(f"a chunked-attention cache cannot go back to position {self.offset - n}: it holds "
                            f"positions from {self.start} on (chunks of {self.chunk}; earlier ones are dropped)")
        self.offset -= n
        return n

    def hold(self, keys: mx.array, values: mx.array, offset: int) -> None:
        """Hold ``keys``/``values`` (B, n_kv_heads, n, head_dim), the last n positions
        before ``offset``; they must reach back to the chunk of position ``offset``."""
        start = offset - keys.shape[2]
        if start > self.chunk_start(offset):
            raise UserError(f"a chunked-attention cache at position {offset} needs the positions from "
                            f"{self.chunk_start(offset)}, got them from {start}")
        self.keys, self.values, self.offset, self.start = keys, values, offset, start

    @property
    def state(self) -> tuple:
        if self.keys is None:
            return ()
        held = self.offset - self.start
        return self.keys[..., :held, :], self.values[..., :held, :]

    @state.setter
    def state(self, value):
        self.keys, self.values = value

    @property
    def meta_state(self) -> dict:
        return {"kind": "ChunkedKVCache", "chunk": self.chunk, "offset": self.offset, "start": self.start}

    @meta_state.setter
    def meta_state(self, meta: dict):
        self.chunk, self.offset, self.start = int(meta["chunk"]), int(meta["offset"]), int(meta["start"])

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def layer_chunked_mask(cache, length: int, chunk: int):
    """The mask of a chunked layer's ``length`` new queries over its ``cache`` (None: no
    cache). A ``ChunkedKVCache`` knows which positions it holds, and a batched cache (one
    offset per row, rows at different positions) builds it from each row's own positions,
    so that each row's chunks start where its own do: both build it themselves. Any other
    cache (``KVCache``, ``QuantizedKVCache``) holds every position from 0."""
    if isinstance(cache, ChunkedKVCache) or (cache is not None and not isinstance(cache.offset, int)):
        return cache.make_mask(length, chunk=chunk)
    return chunked_mask(cache.offset if cache is not None else 0, length, chunk)
