"""``PrefixCache``: the server's shared prefix store, the layer caches of finished requests
reused by later ones (`mlx-tfm server --prompt-cache-bytes` bounds it).

A new request reuses the entry with the longest common token prefix (a multi-turn chat
or a shared system prompt skips what was already computed); entries are ``TokenCache``
objects, so the ids always say exactly what the keys and values hold, and a request
only ever reuses positions whose tokens equal its own: one conversation's tokens never
reach another's. Least recently used entries go first when the total passes
``max_bytes``.

A recurrent layer's state cannot be cut back to a shorter prefix, so an entry with such
layers is only reused from a position where its state is at hand: its end, or a snapshot
(the engine takes them every ``SNAPSHOT_INTERVAL`` prompt tokens and at the prompt's end,
``TokenCache.resumable``). ``find`` counts only those positions, so what a request is told
it reused (``cached_tokens``) is what it really did not compute again.
"""

from __future__ import annotations

from collections import OrderedDict

from ..generation.token_cache import TokenCache, common_prefix_length


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, TokenCache] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._next_key = 0

    def find(self, tokens: list[int], limit: int) -> tuple[int | None, int]:
        """The key of the entry sharing the longest prefix with ``tokens`` and that length
        (at most ``limit``); (None, 0) when none shares any. Changes nothing."""
        best_key, best_length = None, 0
        for key, entry in self.entries.items():
            length = entry.resumable(min(common_prefix_length(entry.tokens, tokens), limit))
            if length > best_length:
                best_key, best_length = key, length
        return best_key, best_length

    def lookup(self, tokens: list[int], limit: int) -> tuple[TokenCache | None, int]:
        """As ``find``, returning the entry; counts a hit or a miss and marks the entry
        as used."""
        key, length = self.find(tokens, limit)
        if key is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        self.entries.move_to_end(key)
        return self.entries[key], length

    def insert(self, entry: TokenCache) -> None:
        """Keep ``entry`` (its layers each holding all of ``entry.tokens``). An entry whose
        tokens are a prefix of the new one's is dropped; a new one that is a prefix of a
        kept entry adds nothing."""
        if not entry.tokens or entry.nbytes > self.max_bytes:
            return
        for key, other in list(self.entries.items()):
            shared = common_prefix_length(other.tokens, entry.tokens)
            if shared == len(entry.tokens):
                self._absorb(key, entry)
                return
            if shared == len(other.tokens):
                entry.absorb(other)  # its recurrent states stay resumable inside the new entry
                self._remove(key)
        self.entries[self._next_key] = entry
        self._next_key += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._remove(next(iter(self.entries)))

    def _absorb(self, key: int, prefix: TokenCache) -> None:
        """The kept entry ``key`` holds all of ``prefix``: it takes the prefix's recurrent
        states as snapshots (nothing without recurrent layers) and counts as just used."""
        kept = self.entries[key]
        self.nbytes -= kept.nbytes
        kept.absorb(prefix)
        self.nbytes += kept.nbytes
        self.entries.move_to_end(key)
        while self.nbytes > self.max_bytes and len(self.entries) > 1:
            self._remove(next(iter(self.entries)))
        if self.nbytes > self.max_bytes:
            self._remove(key)

    def _remove(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    def __len__(self) -> int:
        return len(self.entries)


__all__ = ["PrefixCache"]
