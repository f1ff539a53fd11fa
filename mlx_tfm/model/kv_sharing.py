"""Key/value sharing across the last layers (Gemma 4): the last ``num_kv_shared_layers``
layers compute only queries and attend with the keys and values of the last earlier layer
of their own type (sliding or full), as that layer fetched them from its cache in the same
forward pass. They keep no cache of their own: ``Model.make_cache`` makes caches for the
layers before them only, and the stack hands each shared layer a ``SharedKV`` that reads
what the source layer's ``KVPublisher`` recorded.
"""

from __future__ import annotations

from .config import ModelArgs


def first_shared_layer(args: ModelArgs) -> int:
    """The index of the first layer that reuses another's keys and values (= the number
    of layers with a cache of their own)."""
    return args.num_hidden_layers - args.num_kv_shared_layers


def kv_sources(args: ModelArgs) -> list[int]:
    """Per layer, the layer whose keys and values it attends with: itself before the
    shared layers; for a shared layer, the last earlier layer of its type."""
    first = first_shared_layer(args)
    own = list(range(first))
    last_of_type = {args.layer_types[i]: i for i in own}
    missing = {args.layer_types[i] for i in range(first, args.num_hidden_layers)} - set(last_of_type)
    if missing:
        raise ValueError(f"KV-shared layers of type {', '.join(sorted(missing))} have no earlier layer of "
                         "that type to share keys and values from")
    return own + [last_of_type[args.layer_types[i]] for i in range(first, args.num_hidden_layers)]


class KVPublisher:
    """A source layer's cache (or None without a cache) that records the keys and values
    it returns, and the offset the new queries started at, for the layers sharing them."""

    def __init__(self, cache):
        self.cache = cache
        self.start = 0
        self.keys = self.values = None

    @property
    def offset(self):
        return self.cache.offset if self.cache is not None else 0

    def update_and_fetch(self, keys, values):
        self.start = self.offset
        if self.cache is not None:
            keys, values = self.cache.update_and_fetch(keys, values)
        self.keys, self.values = keys, values
        return keys, values


class SharedKV:
    """What a shared layer reads in place of a cache: its source's keys and values (B,
    n_kv_heads, S, head_dim) of this forward pass, and the queries' first position."""

    def __init__(self, source: KVPublisher):
        self.source = source

    @property
    def offset(self):
        return self.source.start

    def fetch(self):
        if self.source.keys is None:
            raise ValueError("a KV-shared layer ran before the layer it shares keys and values with")
        return self.source.keys, self.source.values


def wire_shared_caches(args: ModelArgs, caches: list) -> list:
    """One entry per layer from the caches of the layers that own one (``caches``, or
    Nones): source layers get a ``KVPublisher`` around theirs, shared layers a ``SharedKV``,
    the others their cache as it is."""
    sources = kv_sources(args)
    publishers = {i: KVPublisher(caches[i]) for i in set(sources[first_shared_layer(args):])}
    return [SharedKV(publishers[s]) if i != s else publishers.get(i, caches[i]) for i, s in enumerate(sources)]
