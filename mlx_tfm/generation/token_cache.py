"""``TokenCache``: a model's layer caches together with exactly the token ids they hold.

The chat REPL keeps one per conversation, ``mlx-tfm generate --prompt-cache-file`` saves and
reloads one, and the server keeps many (the longest shared prefix of a new request is
reused). All of them need the same three things, which live here once:

- bookkeeping: ``tokens`` is always exactly what every layer cache holds, in order;
- reuse: ``prepare(target)`` trims the cache back to its common prefix with the tokens a
  new request needs and returns what is left to feed;
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
from .prompt_cache import load_prompt_cache, save_prompt_cache

# Values read from each weight for the digest: enough that two fine-tunes, two adapters or
# two quantizations of one model differ, cheap enough for a 100-billion-weight model.
DIGEST_SAMPLES = 64


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
    ``kv_quantization`` its layers are ``QuantizedKVCache``s (rotating ones stay float)."""

    def __init__(self, model, max_kv_size: int | None = None, layers: list | None = None, tokens: list[int] = (),
                 kv_quantization: KVQuantization | None = None):
        self.model = model
        self.max_kv_size = max_kv_size
        self.kv_quantization = kv_quantization
        self.layers = layers if layers is not None else self._new_layers()
        self.tokens: list[int] = list(tokens)

    def _new_layers(self) -> list:
        return quantized_layers(self.model.make_cache(max_kv_size=self.max_kv_size), self.kv_quantization)

    @property
    def offset(self) -> int:
        return self.layers[0].offset

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def reset(self) -> None:
        self.layers = self._new_layers()
        self.tokens = []

    def record(self, tokens: list[int]) -> None:
        """``tokens`` were fed through the model into the layer caches."""
        self.tokens += list(tokens)

    def trim_to(self, length: int) -> bool:
        """Make every layer hold exactly the first ``length`` tokens; False (and nothing
        trusted) when a layer cannot (a rotating cache that has wrapped)."""
        excess = [layer.offset - length for layer in self.layers]
        if any(n < 0 or (n and not layer.is_trimmable()) for n, layer in zip(excess, self.layers)):
            return False
        for n, layer in zip(excess, self.layers):
            layer.trim(n)
        self.tokens = self.tokens[:length]
        return True

    def prepare(self, target: list[int]) -> list[int]:
        """Trim to the common prefix with ``target`` and return the tokens still to feed:
        at least the last one, since the next token's logits come from it. A cache that
        cannot be trimmed there starts again from nothing."""
        common = min(common_prefix_length(self.tokens, target), len(target) - 1)
        if not self.trim_to(common):
            self.reset()
            common = 0
        return list(target[common:])

    def reconcile(self, known: list[int]) -> None:
        """After generation the layers hold a prefix of ``known`` (prompt and answer ids),
        or one token more that was never handed out: keep what is known, drop the rest."""
        offsets = {layer.offset for layer in self.layers}
        if len(offsets) != 1:  # a layer was left behind mid-step: nothing can be trusted
            self.reset()
            return
        self.tokens = list(known)
        if not self.trim_to(min(offsets.pop(), len(known))):
            self.reset()

    def copy(self) -> "TokenCache":
        """An independent copy: feeding either never changes the other."""
        layers = []
        for layer in self.layers:
            if isinstance(layer, QuantizedKVCache):
                layers.append(layer.copy())
                continue
            twin = type(layer).__new__(type(layer))
            twin.__dict__.update(layer.__dict__)
            if layer.keys is not None:  # new arrays: the caches write into theirs in place
                twin.keys, twin.values = mx.array(layer.keys), mx.array(layer.values)
            layers.append(twin)
        return TokenCache(self.model, self.max_kv_size, layers, self.tokens, self.kv_quantization)

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
        if fingerprint != model_fingerprint(model):
            raise UserError(
                f"{path} was written for a different model, dtype or adapter; delete it or pick another file"
            )
        return cls(model, max_kv_size, quantized_layers(layers, kv_quantization), tokens, kv_quantization)


__all__ = ["TokenCache", "common_prefix_length", "model_fingerprint"]
