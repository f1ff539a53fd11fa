"""Where a generation or the batching engine makes its caches: Llama 4's chunked-attention
layers bounded to their current chunk (``ChunkedKVCache``, chunked_cache.py) in place of
the ``KVCache`` that ``Model.make_cache`` gives them."""

from __future__ import annotations

from .cache import KVCache
from .chunked_cache import ChunkedKVCache
from .transformer import Model


def chunk_bounded(model, layers: list) -> list:
    """``layers`` (from ``model.make_cache``, nothing fed yet) with each chunked-attention
    layer's ``KVCache`` replaced by a ``ChunkedKVCache``; unchanged for a model that is no
    ``Model`` (a wrapper, or a test's own). The list itself is changed and returned."""
    if not isinstance(model, Model):
        return layers
    for i, chunk in enumerate(model.model.chunks[: len(layers)]):
        if chunk is not None and type(layers[i]) is KVCache and not layers[i].offset:
            layers[i] = ChunkedKVCache(chunk)
    return layers
