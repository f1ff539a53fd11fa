"""Prompt-cache files: a list of layer caches written to one .safetensors file (their
arrays, the kinds and settings of the caches as metadata) and read back. A recurrent
layer's ``StateCache`` is stored as its state arrays (``{layer}.state.{j}``) and its
``meta_state`` (size and offset); Falcon-H1's ``ParallelCache`` as its attention's keys and
values and its state's arrays under the layer's one index, with both metas.

``TokenCache`` (``token_cache.py``) adds the token ids and the model's fingerprint, so a
file is only reused with the model and tokens it was made from.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..model.cache import (
    KVCache,
    KVQuantization,
    QuantizedKV,
    QuantizedKVCache,
    RotatingKVCache,
)
from ..model.chunked_cache import ChunkedKVCache
from ..model.mamba import ParallelCache
from ..model.state_cache import StateCache

QUANTIZED_PARTS = ("data", "scales", "biases")  # QuantizedKV's arrays, as named in prompt-cache files


def save_prompt_cache(path: str | Path, cache: list, metadata: dict[str, str] | None = None) -> None:
    """Write a list of layer caches to a .safetensors file (atomically)."""
    import json

    from ..atomic import atomic_file

    arrays = {}
    for i, layer_cache in enumerate(cache):
        if isinstance(layer_cache, ParallelCache):  # keys and values, and the state beside them
            arrays.update(attention_arrays(i, layer_cache.attention))
            arrays.update(state_arrays(i, layer_cache.mamba))
        elif isinstance(layer_cache, StateCache):
            arrays.update(state_arrays(i, layer_cache))
        else:
            arrays.update(attention_arrays(i, layer_cache))
    info = {"layers": json.dumps([c.meta_state for c in cache]), **(metadata or {})}
    with atomic_file(path) as tmp:
        mx.save_safetensors(str(tmp), arrays, metadata=info)


def state_arrays(layer: int, state: StateCache) -> dict[str, mx.array]:
    return {f"{layer}.state.{j}": a for j, a in enumerate(state.state)}


def attention_arrays(layer: int, attention) -> dict[str, mx.array]:
    """An attention cache's keys and values (a quantized one's parts each) by file name."""
    arrays = {}
    for name, stored in zip(("keys", "values"), attention.state):
        if isinstance(stored, QuantizedKV):
            arrays.update({f"{layer}.{name}.{part}": a for part, a in zip(QUANTIZED_PARTS, stored.arrays)})
        else:
            arrays[f"{layer}.{name}"] = stored
    return arrays


def load_prompt_cache(path: str | Path) -> tuple[list, dict[str, str]]:
    """Read a file written by ``save_prompt_cache``: (layer caches, user metadata)."""
    import json

    arrays, metadata = mx.load(str(path), return_metadata=True)
    layers = json.loads(metadata.pop("layers"))
    cache = []
    for i, meta in enumerate(layers):
        if meta["kind"] == "ParallelCache":
            cache.append(ParallelCache(attention_cache_from_file(arrays, i, meta["attention"]),
                                       state_cache_from_file(arrays, i, meta["mamba"])))
        elif meta["kind"] == "StateCache":
            cache.append(state_cache_from_file(arrays, i, meta))
        else:
            cache.append(attention_cache_from_file(arrays, i, meta))
    return cache, metadata


def attention_cache_from_file(arrays: dict, i: int, meta: dict):
    """Layer ``i``'s attention cache of the kind ``meta`` names, holding its stored keys
    and values (none before it was written)."""
    if meta["kind"] == "RotatingKVCache":
        layer_cache = RotatingKVCache(int(meta["max_size"]), int(meta["keep"]))
    elif meta["kind"] == "ChunkedKVCache":  # Llama 4's chunked layers: their current chunk
        layer_cache = ChunkedKVCache(int(meta["chunk"]))
    elif meta["kind"] == "QuantizedKVCache":
        group_size = None if meta["group_size"] is None else int(meta["group_size"])  # None: not quantized yet
        quantization = KVQuantization(int(meta["bits"]), group_size, int(meta["start"]))
        layer_cache = QuantizedKVCache(quantization)
    else:
        layer_cache = KVCache()
    if f"{i}.keys" in arrays:
        layer_cache.state = (arrays[f"{i}.keys"], arrays[f"{i}.values"])
    elif f"{i}.keys.data" in arrays:
        layer_cache.state = tuple(
            QuantizedKV(*(arrays[f"{i}.{name}.{part}"] for part in QUANTIZED_PARTS), quantization.group_size,
                        quantization.bits)
            for name in ("keys", "values")
        )
    if meta["kind"] in ("RotatingKVCache", "ChunkedKVCache"):  # their positions are not 0 .. n - 1
        layer_cache.meta_state = meta
    return layer_cache


def state_cache_from_file(arrays: dict, layer: int, meta: dict) -> StateCache:
    """Layer ``layer``'s ``StateCache``: its ``size`` arrays (none before it was written)."""
    state = StateCache(int(meta["size"]))
    stored = [arrays[f"{layer}.state.{j}"] for j in range(state_size(arrays, layer))]
    if stored:
        state.state = stored
    state.meta_state = meta
    return state


def state_size(arrays: dict, layer: int) -> int:
    return sum(1 for name in arrays if name.startswith(f"{layer}.state."))
