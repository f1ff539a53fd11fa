"""``BatchChunkedKVCache``: the batched cache of Llama 4's chunked-attention layers (whose
single-sequence cache is a ``ChunkedKVCache``, model/chunked_cache.py).

A ``BatchKVCache`` whose window is the chunk: a query never sees further back than its
own chunk's start, at most ``chunk - 1`` positions before it, so the last ``chunk`` slots
are all any row needs whatever its position, and memory stays bounded. The mask is each
row's own chunks (``BatchKVCache.chunked_mask``). Rows come from, and go back to, the
one-chunk single-sequence caches: a row starts from a prefix when the entry still holds
that prefix's current chunk, and a finished row hands back its current chunk.
"""

from __future__ import annotations

from ..model.chunked_cache import ChunkedKVCache
from .batch_cache import BatchKVCache, register_batch_cache


class BatchChunkedKVCache(BatchKVCache):
    """B right-aligned rows of a chunked-attention layer; ``window`` is the chunk."""

    @property
    def chunk(self) -> int:
        return self.window

    def _chunk_start(self, position: int) -> int:
        return position - position % self.chunk

    def row_from(self, single: ChunkedKVCache | None, length: int) -> "BatchChunkedKVCache | None":
        """A row at position ``length``, holding positions ``chunk_start(length) ..
        length - 1`` of ``single`` (None when it no longer holds them)."""
        if single is None or not length:
            return type(self).for_row(None, None, length, self.window)
        first = self._chunk_start(length)  # the chunk of the row's next query
        if length > single.offset or first < single.start:
            return None
        keys, values = single.state  # (1, n_kv_heads, offset - start, head_dim)
        held = slice(first - single.start, length - single.start)
        return type(self).for_row(keys[..., held, :], values[..., held, :], length, self.window)

    def _needed(self, length: int) -> int:
        """How many positions a single-sequence cache at ``length`` holds: its current chunk's."""
        return length - self._chunk_start(length - 1) if length else 0

    def holds_all(self, row: int, length: int) -> bool:
        return self.row_length(row) >= self._needed(length)

    def export_row(self, row: int, into: ChunkedKVCache) -> None:
        length = int(self.offset[row].item())
        n = self._needed(length)
        if n:
            keys, values = self.row_state(row)  # (1, n_kv_heads, row_length, head_dim)
            into.hold(keys[..., -n:, :], values[..., -n:, :], length)


register_batch_cache(ChunkedKVCache, lambda layer: BatchChunkedKVCache(layer.chunk))
