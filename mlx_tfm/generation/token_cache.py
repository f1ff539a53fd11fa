"""``TokenCache``: a model's layer caches together with exactly the token ids they hold.

The chat REPL keeps one per conversation, ``mlx-tfm generate --prompt-cache-file`` saves and
reloads one, and the server keeps many (the longest shared prefix of a new request is
reused). All of them need the same three things, which live here once:

- bookkeeping: ``tokens`` is always exactly what every layer cache holds, in order;
- reuse: ``prepare(target)`` trims the cache back to its common prefix with the tokens a
  new request needs and returns what is left to feed. A recurrent layer's ``StateCache``
  cannot be trimmed: ``snapshot()`` keeps copies of those layers at a position (chat takes
  one after every answer), and a cache that cannot be trimmed goes back to the longest
  snapshot inside the common prefix instead (else it starts again from nothing);
- identity: a fingerprint of the model (architecture, dtype, and a digest of every weight,
  adapters included) written with a saved cache, so a file saved for one model, dtype or
  adapter is never reused with another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import UserError
from ..model.cache import KVQuantization, QuantizedKVCache, quantized_layers
from ..model.chunk_bound import chunk_bounded
from ..model.chunked_cache import ChunkedKVCache
from ..model.mamba import ParallelCache
from ..model.state_cache import StateCache
from .prompt_cache import load_prompt_cache, save_prompt_cache
from .step import prefill

# Values read from each weight for the digest: enough that two fine-tunes, two adapters or
# two quantizations of one model differ, cheap enough for a 100-billion-weight model.
DIGEST_SAMPLES = 64
# Snapshots of recurrent layers a TokenCache keeps (the latest positions): chat's last few turns.
MAX_SNAPSHOTS = 8
# The layer caches that keep a recurrent state, which no trim takes back: a recurrent
# layer's own, and Falcon-H1's attention with a Mamba-2 state beside it.
KEEPS_STATE = (StateCache, ParallelCache)


def trims(layer, n: int) -> bool:
    """Whether ``layer`` can forget its last ``n`` positions: a chunked-attention cache
    only within the chunk it holds."""
    if isinstance(layer, ChunkedKVCache):
        return layer.can_trim(n)
    return layer.is_trimmable()


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def weights_digest(model) -> str:
    """A hash of every parameter's name, shape, dtype and ``DIGEST_SAMPLES`` values spread
    through it (LoRA adapters are parameters too)."""
    digest = hashlib.sha256()
    for name, array in tree_flatten(model.parameters()):
        flat = array.reshape(-1)
        step = max(1, flat.size // DIGEST_SAMPLES)
        sample = flat[::step][:DIGEST_SAMPLES]
        values = sample.astype(mx.float32 if mx.issubdtype(sample.dtype, mx.floating) else mx.int64)
        digest.update(f"{name}{tuple(array.shape)}{array.dtype}".encode())
        digest.update(memoryview(values).tobytes())
    return digest.hexdigest()


def model_fingerprint(model) -> str:
    """What a saved cache depends on: the architecture, the weights' dtype and the weights."""
    dtype = str(model.model.embed_tokens.weight.dtype)
    return json.dumps({"args": model.args.to_dict(), "dtype": dtype, "weights": weights_digest(model)}, sort_keys=True)


class TokenCache:
    """One layer cache per model layer and ``tokens``, the ids they hold.

    After feeding tokens through the model with ``layers`` as its cache, call
    ``record(tokens)``; after a generation that may have left the caches one token ahead
    of (or behind) the ids the caller knows, call ``reconcile(known)``. With
    ``kv_quantization`` its layers are ``QuantizedKVCache``s (rotating ones stay float);
    with ``chunk_bound``, Llama 4's chunked layers keep their current chunk only
    (``ChunkedKVCache``: the CLI's generate and chat ask for it)."""

    def __init__(self, model, max_kv_size: int | None = None, layers: list | None = None, tokens: list[int] = (),
                 kv_quantization: KVQuantization | None = None, chunk_bound: bool = False):
        self.model = model
        self.max_kv_size = max_kv_size
        self.kv_quantization = kv_quantization
        self.chunk_bound = chunk_bound  # Llama 4's chunked layers kept to their chunk (chunk_bound.py)
        self.layers = layers if layers is not None else self._new_layers()
        self.tokens: list[int] = list(tokens)
        # position -> {layer index: a copy of that recurrent layer's StateCache there}
        self.snapshots: dict[int, dict[int, StateCache | ParallelCache]] = {}

    def _new_layers(self) -> list:
        layers = self.model.make_cache(max_kv_size=self.max_kv_size)
        return quantized_layers(chunk_bounded(self.model, layers) if self.chunk_bound else layers, self.kv_quantization)

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    @property
    def nbytes(self) -> int:
        """Bytes of the layers and of the recurrent layers' snapshots."""
        snapshots = sum(state.nbytes for states in self.snapshots.values() for state in states.values())
        return sum(layer.nbytes for layer in self.layers) + snapshots

    def reset(self) -> None:
        self.layers = self._new_layers()
        self.tokens = []
        self.snapshots = {}

    def snapshot(self) -> None:
        """Keep copies of the recurrent layers' states as they are now (at ``len(tokens)``),
        so that ``prepare`` can go back here; nothing to keep when every layer trims."""
        recurrent = {i: layer.copy() for i, layer in enumerate(self.layers) if isinstance(layer, KEEPS_STATE)}
        if not recurrent or self.offset != len(self.tokens):
            return
        self.snapshots[len(self.tokens)] = recurrent
        for old in sorted(self.snapshots)[:-MAX_SNAPSHOTS]:
            del self.snapshots[old]

    def has_states(self) -> bool:
        """Whether some layer keeps a recurrent state (which no trim can take back)."""
        return any(isinstance(layer, KEEPS_STATE) for layer in self.layers)

    def feed_to_snapshot(self, feed: list[int]) -> list[int]:
        """With recurrent layers: feed all of ``feed`` but its last token now, record it and
        ``snapshot()`` there, so that this prompt (or one that extends it) can be returned
        to later; returns what is still to feed. Without them, ``feed`` unchanged."""
        if not self.has_states() or len(feed) < 2:
            return list(feed)
        prefill(self.model, mx.array(feed[:-1], dtype=mx.int32), self.layers)
        self.record(feed[:-1])
        self.snapshot()
        return list(feed[-1:])

    def resumable(self, length: int) -> int:
        """The longest prefix, of at most ``length`` tokens, that a new sequence can start
        from these layers: any when every layer can be cut short; with recurrent layers
        only a position where their state is at hand (a snapshot, or the end)."""
        if not self.has_states():
            return length
        return max((n for n in (*self.snapshots, len(self.tokens)) if n <= length), default=0)

    def layers_at(self, position: int) -> list:
        """Layers to read the first ``position`` tokens from (``position`` resumable): the
        attention layers as they are (a reader takes only their first positions) and each
        recurrent layer's state at ``position``."""
        if position == len(self.tokens) or not self.has_states():
            return self.layers
        saved = self.snapshots[position]
        return [saved.get(i, layer) for i, layer in enumerate(self.layers)]

    def absorb(self, other: "TokenCache") -> None:
        """Keep the recurrent states of ``other``, whose tokens are a prefix of ours, as
        snapshots here (its own snapshots too), so that its positions stay resumable."""
        if not self.has_states():
            return
        states = {i: layer for i, layer in enumerate(other.layers) if isinstance(layer, KEEPS_STATE)}
        self.snapshots = {**other.snapshots, len(other.tokens): states, **self.snapshots}

    def rewind(self, length: int) -> int:
        """Hold at most the first ``length`` tokens: exactly ``length`` where every layer
        trims there, else the longest snapshot within them (0: started again). Returns how
        many tokens are held."""
        if self.trim_to(length):
            return length
        usable = [n for n in self.snapshots if n <= length]
        if not usable or not self._restore(max(usable)):
            self.reset()
            return 0
        return len(self.tokens)

    def _restore(self, position: int) -> bool:
        """Trim the trimmable layers to ``position`` and put the snapshot's states back."""
        saved = self.snapshots[position]
        others = [(i, layer) for i, layer in enumerate(self.layers) if i not in saved]
        if any(layer.offset < position or (layer.offset > position and not trims(layer, layer.offset - position))
               for _, layer in others):
            return False
        for _, layer in others:
            layer.trim(layer.offset - position)
        for i, state in saved.items():
            self.layers[i] = state.copy()  # the snapshot stays as it was, for another rewind
        self.tokens = self.tokens[:position]
        self.snapshots = {n: states for n, states in self.snapshots.items() if n <= position}
        return True

    def record(self, tokens: list[int]) -> None:
        """``tokens`` were fed through the model into the layer caches."""
        self.tokens += list(tokens)

    def trim_to(self, length: int) -> bool:
        """Make every layer hold exactly the first ``length`` tokens; False (and nothing
        trusted) when a layer cannot (a rotating cache that has wrapped)."""
        excess = [layer.offset - length for layer in self.layers]
        if any(n < 0 or (n and not trims(layer, n)) for n, layer in zip(excess, self.layers)):
            return False
        for n, layer in zip(excess, self.layers):
            layer.trim(n)
        self.tokens = self.tokens[:length]
        self.snapshots = {n: states for n, states in self.snapshots.items() if n <= length}
        return True

    def prepare(self, target: list[int]) -> list[int]:
        """Trim to the common prefix with ``target`` and return the tokens still to feed:
        at least the last one, since the next token's logits come from it. A cache that
        cannot be trimmed there goes back to its longest snapshot inside the prefix, or
        starts again from nothing."""
        common = min(common_prefix_length(self.tokens, target), len(target) - 1)
        return list(target[self.rewind(common):])

    def reconcile(self, known: list[int]) -> None:
        """After generation the layers hold a prefix of ``known`` (prompt and answer ids),
        or one token more that was never handed out: keep what is known, drop the rest."""
        offsets = {layer.offset for layer in self.layers}
        if len(offsets) != 1:  # a layer was left behind mid-step: nothing can be trusted
            self.reset()
            return
        self.tokens = list(known)[: offsets.pop()]
        self.rewind(len(self.tokens))

    def copy(self) -> "TokenCache":
        """An independent copy: feeding either never changes the other."""
        layers = []
        for layer in self.layers:
            if isinstance(layer, (QuantizedKVCache, *KEEPS_STATE)):
                layers.append(layer.copy())
                continue
            twin = type(layer).__new__(type(layer))
            twin.__dict__.update(layer.__dict__)
            if layer.keys is not None:  # new arrays: the caches write into theirs in place
                twin.keys, twin.values = mx.array(layer.keys), mx.array(layer.values)
            layers.append(twin)
        twin = TokenCache(self.model, self.max_kv_size, layers, self.tokens, self.kv_quantization, self.chunk_bound)
        twin.snapshots = dict(self.snapshots)  # their states are copied again when restored
        return twin

    # -- files ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the caches, their token ids and the model's fingerprint (atomically)."""
        if self.offset != len(self.tokens):
            raise ValueError(f"the cache holds {self.offset} positions, not the {len(self.tokens)} tokens recorded")
        metadata = {"tokens": json.dumps(self.tokens), "model": model_fingerprint(self.model)}
        save_prompt_cache(path, self.layers, metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, model, max_kv_size: int | None = None,
             kv_quantization: KVQuantization | None = None) -> "TokenCache":
        """A cache saved by ``save`` for this very model (else a one-line error). Its
        quantized layers stay so; with ``kv_quantization`` its float ``KVCache`` layers
        become ``QuantizedKVCache``s too."""
        path = Path(path)
        try:
            layers, metadata = load_prompt_cache(path)
            tokens = json.loads(metadata["tokens"])
            fingerprint = metadata["model"]
        except Exception as e:
            raise UserError(f"{path} is not a prompt cache file written by mlx-tfm ({e})") from None
        check_layout(path, layers, model)
        if fingerprint != model_fingerprint(model):
            raise UserError(
                f"{path} was written for a different model, dtype or adapter; delete it or pick another file"
            )
        return cls(model, max_kv_size, quantized_layers(layers, kv_quantization), tokens, kv_quantization)


def check_layout(path: Path, layers: list, model) -> None:
    """One line naming the first layer whose saved kind (a recurrent state, keys and
    values, or both) is not what this model's layer keeps."""
    expected = model.make_cache()  # another number of layers: the fingerprint check names it
    for i, (saved, own) in enumerate(zip(layers, expected)):
        if layout_kind(saved) != layout_kind(own):
            raise UserError(f"{path} holds {layout_kind(saved)} for layer {i}, but this model's "
                            f"layer {i} keeps {layout_kind(own)}: it was written for another layout")


def layout_kind(layer) -> str:
    """What a layer cache keeps, in words."""
    if isinstance(layer, ParallelCache):
        return "keys and values beside a recurrent state"
    return "a recurrent state" if isinstance(layer, StateCache) else "keys and values"


__all__ = ["TokenCache", "KEEPS_STATE", "common_prefix_length", "model_fingerprint"]
