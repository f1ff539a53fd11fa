"""Key/value caches: one object per layer, made by ``Model.make_cache``.

Keys and values are stored as the model computes them, ``(B, n_kv_heads, L, head_dim)``,
RoPE already applied and the KV heads never repeated (the fused attention op handles
GQA). A cache also answers which keys a new chunk of queries may see (``make_mask``),
because only it knows which absolute positions its slots hold.

``QuantizedKVCache`` stores them quantized (``mx.quantize``, 4 or 8 bits) once it holds
more than ``start`` positions and returns ``QuantizedKV`` triples, which ``attention``
reads with ``mx.quantized_matmul`` without a dequantized copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from ..errors import UserError


def window_mask(query_positions: mx.array, key_positions: mx.array, window: int | None, keep: int = 0) -> mx.array:
    """Boolean mask (L, S): query i sees key j when j is not in its future and, with a
    window, lies fewer than ``window`` positions back (or among the first ``keep``)."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = k <= q
    if window is not None:
        visible = visible & ((q - k < window) | (k < keep))
    return visible


@dataclass(frozen=True)
class CausalRows:
    """The causal mask of a chunk of L queries over rows that start at different slots,
    kept in its two parts: query l of row b sees slot s when s <= S - L + l (causal, the
    chunk at the end of the slots) and ``rows[b, 0, 0, s]`` (the row's own slots). A
    kernel that takes both never builds the (B, 1, L, S) array; ``array`` builds it for
    every other route."""

    rows: mx.array  # (B, 1, 1, S) booleans

    def array(self, length: int) -> mx.array:
        slots = self.rows.shape[-1]
        return self.rows & window_mask(mx.arange(slots - length, slots), mx.arange(slots), None)  # (B, 1, L, S)


def growing_mask(offset: int, length: int, window: int | None):
    """The mask of ``length`` new queries over a cache that holds every position so far."""
    if window is None or offset + length <= window:
        return "causal" if length > 1 else None
    queries = mx.arange(offset, offset + length)
    return window_mask(queries, mx.arange(offset + length), window)


class KVCache:
    """A cache that grows in steps of ``step`` positions and never forgets."""

    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.reserved = 0

    def reserve(self, positions: int) -> None:
        """Say that the coming work caches at most ``positions`` positions in all (a
        generation knows its prompt and token budget), so that growing stops there rather
        than at the end of a ``step``: a 48-token generation of the 135M model then holds
        1.1 MB of keys and values instead of 5.9 MB. Past it, growth goes in steps again."""
        self.reserved = positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``(B, n_kv_heads, L, head_dim)`` keys/values; return all cached so far."""
        previous = self.offset
        length = keys.shape[2]
        if self.keys is None or previous + length > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_new = ((length + self.step - 1) // self.step) * self.step
            if previous + length <= self.reserved:
                n_new = min(n_new, self.reserved - previous)
            new_keys = mx.zeros((B, n_kv_heads, n_new, k_head_dim), keys.dtype)
            new_values = mx.zeros((B, n_kv_heads, n_new, v_head_dim), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_keys, new_values
            else:
                self.keys = mx.concatenate([self.keys[..., :previous, :], new_keys], axis=2)
                self.values = mx.concatenate([self.values[..., :previous, :], new_values], axis=2)
        self.offset += length
        self.keys[..., previous : self.offset, :] = keys
        self.values[..., previous : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def make_mask(self, length: int, window: int | None = None):
        """Mask for ``length`` new queries; ``"causal"`` lets the fused kernel build it."""
        return growing_mask(self.offset, length, window)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions (for undo and prompt-cache reuse)."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            return ()
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, value):
        self.keys, self.values = value
        self.offset = self.keys.shape[2]

    @property
    def meta_state(self) -> dict:
        return {"kind": "KVCache"}

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class RotatingKVCache:
    """A cache bounded by ``max_size`` positions: the oldest are overwritten, except the
    first ``keep`` (attention sinks, or a system prompt worth keeping).

    Single tokens are written in place into a ring buffer. A multi-token chunk is
    attended together with the whole window, then only the last ``max_size`` positions
    are kept, so a long prompt is processed correctly in one call.
    """

    step = 256

    def __init__(self, max_size: int, keep: int = 0):
        if keep >= max_size:
            raise ValueError(f"keep ({keep}) must be smaller than max_size ({max_size})")
        self.max_size = max_size
        self.keep = keep
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._idx = 0  # the slot the next single token is written to
        self.reserved = 0

    def reserve(self, positions: int) -> None:
        """As ``KVCache.reserve``: growing the buffer stops at ``positions`` slots."""
        self.reserved = positions

    # -- the buffer in time order -------------------------------------------------
    def _filled(self) -> int:
        return min(self.offset, self.max_size)

    def _temporal(self, x: mx.array) -> mx.array:
        x = x[..., : self._filled(), :]
        if self.offset <= self.max_size or self._idx in (self.keep, self.max_size):
            return x
        # Slot _idx holds the oldest evictable position: [kept | oldest.. | ..newest]
        return mx.concatenate(
            [x[..., : self.keep, :], x[..., self._idx :, :], x[..., self.keep : self._idx, :]], axis=2
        )

    def _key_positions(self) -> mx.array:
        """Absolute positions of the cached keys, in time order."""
        if self.offset <= self.max_size:
            return mx.arange(self.offset)
        recent = mx.arange(self.offset - (self.max_size - self.keep), self.offset)
        return mx.concatenate([mx.arange(self.keep), recent])

    # -- the cache protocol -------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] == 1:
            return self._update_one(keys, values)
        return self._update_chunk(keys, values)

    def _update_one(self, keys, values):
        if self.keys is None or (self._filled() == self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            self._grow(keys, values)
        if self._idx == self.max_size:
            self._idx = self.keep
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self._idx += 1
        self.offset += 1
        n = self._filled()
        return self.keys[..., :n, :], self.values[..., :n, :]

    def _grow(self, keys, values):
        B, n_kv_heads, _, k_head_dim = keys.shape
        current = 0 if self.keys is None else self.keys.shape[2]
        n_new = min(self.step, self.max_size - current)
        if current < self.reserved:
            n_new = min(n_new, self.reserved - current)
        new_keys = mx.zeros((B, n_kv_heads, n_new, k_head_dim), keys.dtype)
        new_values = mx.zeros((B, n_kv_heads, n_new, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_keys, new_values
        else:
            self.keys = mx.concatenate([self.keys, new_keys], axis=2)
            self.values = mx.concatenate([self.values, new_values], axis=2)

    def _update_chunk(self, keys, values):
        if self.keys is None:
            all_keys, all_values = keys, values
        else:
            all_keys = mx.concatenate([self._temporal(self.keys), keys], axis=2)
            all_values = mx.concatenate([self._temporal(self.values), values], axis=2)
        self.offset += keys.shape[2]
        # Keep the first `keep` positions and the most recent ones: (B, n_kv_heads, <=max_size, head_dim)
        if all_keys.shape[2] > self.max_size:
            recent = self.max_size - self.keep
            self.keys = mx.concatenate([all_keys[..., : self.keep, :], all_keys[..., -recent:, :]], axis=2)
            self.values = mx.concatenate([all_values[..., : self.keep, :], all_values[..., -recent:, :]], axis=2)
        else:
            self.keys, self.values = all_keys, all_values
        self._idx = self.keys.shape[2]
        return all_keys, all_values

    def make_mask(self, length: int, window: int | None = None):
        window = self.max_size if window is None else min(window, self.max_size)
        if length == 1:
            if window >= self.max_size:
                return None  # after the write every cached position lies inside the window
            return self._single_mask(window)
        queries = mx.arange(self.offset, self.offset + length)
        keys = mx.concatenate([self._key_positions(), queries])
        return window_mask(queries, keys, window, self.keep)

    def _single_mask(self, window):
        # Positions per buffer slot after this token is written, in buffer order.
        n = min(self.offset + 1, self.max_size)
        slot = self.keep if self._idx == self.max_size else self._idx
        positions = self._buffer_positions_after_write(n, slot)
        return window_mask(mx.array([self.offset]), positions, window, self.keep)

    def _buffer_positions_after_write(self, n, slot):
        if self.offset + 1 <= self.max_size:
            return mx.arange(n)
        # Ring slots keep..max_size-1 hold consecutive positions ending at `offset` in `slot`.
        ring = self.max_size - self.keep
        slots = mx.arange(self.keep, self.max_size)
        positions = self.offset - ((slot - slots) % ring)
        return mx.concatenate([mx.arange(self.keep), positions])

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self.offset, n) if self.is_trimmable() else 0
        self.offset -= n
        self._idx -= n
        return n

    @property
    def state(self):
        if self.keys is None:
            return ()
        n = self._filled()
        return self.keys[..., :n, :], self.values[..., :n, :]

    @state.setter
    def state(self, value):
        self.keys, self.values = value

    @property
    def meta_state(self) -> dict:
        return {
            "kind": "RotatingKVCache",
            "max_size": self.max_size,
            "keep": self.keep,
            "offset": self.offset,
            "idx": self._idx,
        }

    @meta_state.setter
    def meta_state(self, meta: dict):
        self.max_size, self.keep = int(meta["max_size"]), int(meta["keep"])
        self.offset, self._idx = int(meta["offset"]), int(meta["idx"])

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


KV_BITS = (4, 8)
DEFAULT_QUANTIZED_KV_START = 5000  # mlx_lm's: short contexts stay float, where the cache is small anyway
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports


def default_kv_group_size(head_dim: int) -> int | None:
    """The group size used when none is given: the largest ``mx.quantize`` supports that
    divides ``head_dim`` (so every head is whole groups); None when none does."""
    return max((g for g in KV_GROUP_SIZES if head_dim % g == 0), default=None)


@dataclass(frozen=True)
class KVQuantization:
    """How a ``QuantizedKVCache`` stores keys and values: ``bits`` per number, one scale and
    bias per ``group_size`` numbers of a head (None: ``default_kv_group_size`` of the
    head), from the first update that takes the cache past ``start`` positions (before
    it, float as a ``KVCache``)."""

    bits: int
    group_size: int | None = None
    start: int = 0

    def group_for(self, head_dim: int) -> int:
        """The group size for heads of ``head_dim`` numbers (``check`` refuses a head none fits)."""
        return self.group_size if self.group_size is not None else default_kv_group_size(head_dim)

    def check(self, head_dim: int | None = None) -> None:
        """One-line ``UserError`` for settings ``mx.quantize`` cannot apply (to heads of
        ``head_dim`` numbers, when given)."""
        if self.bits not in KV_BITS:
            raise UserError(f"--kv-bits must be 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size not in KV_GROUP_SIZES:
            raise UserError(f"--kv-group-size must be 32, 64 or 128, got {self.group_size}")
        if head_dim is not None and self.group_size is not None and head_dim % self.group_size:
            raise UserError(f"--kv-group-size {self.group_size} does not divide the model's head_dim {head_dim}: "
                            "its keys cannot be quantized in such groups")
        if head_dim is not None and self.group_for(head_dim) is None:
            raise UserError(f"no KV-cache group size (32, 64 or 128) divides the model's head_dim {head_dim}: "
                            "its keys cannot be quantized")
        if self.start < 0:
            raise UserError(f"--quantized-kv-start must be at least 0, got {self.start}")


class QuantizedKV(NamedTuple):
    """Keys or values as ``mx.quantize`` leaves them, quantized along head_dim in groups:
    ``data`` (B, n_kv_heads, S, head_dim * bits / 32) uint32, ``scales`` and ``biases``
    (B, n_kv_heads, S, head_dim / group_size) in the model's dtype."""

    data: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    @classmethod
    def quantize(cls, x: mx.array, group_size: int, bits: int) -> "QuantizedKV":
        return cls(*mx.quantize(x, group_size=group_size, bits=bits), group_size, bits)

    @property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.data, self.scales, self.biases

    def positions(self, start: int, stop: int) -> "QuantizedKV":
        """Positions ``start:stop`` (axis 2) of every array."""
        data, scales, biases = (a[..., start:stop, :] for a in self.arrays)
        return QuantizedKV(data, scales, biases, self.group_size, self.bits)

    def dequantize(self) -> mx.array:
        return mx.dequantize(*self.arrays, group_size=self.group_size, bits=self.bits)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class QuantizedKVCache:
    """A never-forgetting cache like ``KVCache`` that stores keys and values quantized.

    Until an update would take it past ``quantization.start`` positions it holds them in
    float (a ``KVCache`` inside); that update quantizes what it held, and from then on
    ``update_and_fetch`` returns ``QuantizedKV`` keys and values (attention reads them with
    ``mx.quantized_matmul``). Trimming works in both phases; a trimmed cache stays quantized.
    """

    step = 256

    def __init__(self, quantization: KVQuantization):
        self.quantization = quantization
        self.unquantized: KVCache | None = KVCache()  # None once quantized
        self.keys: QuantizedKV | None = None  # buffers with room to grow along axis 2
        self.values: QuantizedKV | None = None
        self.offset = 0
        self.reserved = 0

    def reserve(self, positions: int) -> None:
        """As ``KVCache.reserve``."""
        self.reserved = positions
        if self.unquantized is not None:
            self.unquantized.reserve(min(positions, self.quantization.start))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append ``(B, n_kv_heads, L, head_dim)`` keys/values; return all cached so far,
        float before ``start`` and ``QuantizedKV`` after."""
        length = keys.shape[2]
        if self.unquantized is not None:
            if self.offset + length <= self.quantization.start:
                self.offset += length
                return self.unquantized.update_and_fetch(keys, values)
            self._quantize_held()
        return self._append(*(self._quantized(x) for x in (keys, values)))

    def _quantize_held(self) -> None:
        held = self.unquantized.state
        self.unquantized, self.offset = None, 0
        if held:
            self._append(*(self._quantized(x) for x in held))

    def _quantized(self, x: mx.array) -> QuantizedKV:
        """``x`` (B, n_kv_heads, L, head_dim) quantized along head_dim."""
        q = self.quantization
        return QuantizedKV.quantize(x, q.group_for(x.shape[-1]), q.bits)

    def _append(self, keys: QuantizedKV, values: QuantizedKV):
        previous = self.offset
        length = keys.data.shape[2]
        if self.keys is None or previous + length > self.keys.data.shape[2]:
            self._grow(keys, values, previous, length)
        stop = previous + length
        for buffer, new in ((self.keys, keys), (self.values, values)):
            for array, part in zip(buffer.arrays, new.arrays):
                array[..., previous:stop, :] = part
        self.offset = stop
        return self.keys.positions(0, stop), self.values.positions(0, stop)

    def _grow(self, keys: QuantizedKV, values: QuantizedKV, previous: int, length: int) -> None:
        n_new = ((length + self.step - 1) // self.step) * self.step
        if previous + length <= self.reserved:
            n_new = min(n_new, self.reserved - previous)

        def grown(buffer: QuantizedKV | None, like: QuantizedKV) -> QuantizedKV:
            arrays = []
            for i, part in enumerate(like.arrays):
                B, n_kv_heads, _, width = part.shape
                room = mx.zeros((B, n_kv_heads, n_new, width), part.dtype)
                arrays.append(room if buffer is None else mx.concatenate([buffer.arrays[i][..., :previous, :], room], axis=2))
            return QuantizedKV(*arrays, like.group_size, like.bits)

        self.keys, self.values = grown(self.keys, keys), grown(self.values, values)

    def make_mask(self, length: int, window: int | None = None):
        return growing_mask(self.offset, length, window)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if self.unquantized is not None:
            self.unquantized.trim(n)
        self.offset -= n
        return n

    @property
    def is_quantized(self) -> bool:
        return self.unquantized is None

    @property
    def state(self):
        """(keys, values): float arrays before quantizing, ``QuantizedKV`` after."""
        if self.unquantized is not None:
            return self.unquantized.state
        if self.keys is None:
            return ()
        return self.keys.positions(0, self.offset), self.values.positions(0, self.offset)

    @state.setter
    def state(self, value):
        keys, values = value
        if isinstance(keys, QuantizedKV):
            self.unquantized = None
            self.keys, self.values = keys, values
            self.offset = keys.data.shape[2]
        else:
            self.unquantized = KVCache()
            self.unquantized.state = (keys, values)
            self.offset = keys.shape[2]

    @property
    def meta_state(self) -> dict:
        q = self.quantization
        # the group size the keys were quantized with (None: not yet, and none was given)
        group_size = self.keys.group_size if self.keys is not None else q.group_size
        return {"kind": "QuantizedKVCache", "bits": q.bits, "group_size": group_size, "start": q.start,
                "quantized": self.is_quantized}

    def copy(self) -> "QuantizedKVCache":
        """An independent copy (new buffers: the cache writes into its own in place)."""
        twin = QuantizedKVCache(self.quantization)
        twin.offset, twin.reserved = self.offset, self.reserved
        if self.unquantized is not None:
            twin.unquantized.reserve(self.unquantized.reserved)
            if self.unquantized.keys is not None:
                twin.unquantized.state = tuple(mx.array(x) for x in self.unquantized.state)
        else:
            twin.unquantized = None
            twin.keys, twin.values = (QuantizedKV(*(mx.array(a) for a in buffer.arrays), buffer.group_size, buffer.bits)
                                      for buffer in (self.keys, self.values))
        return twin

    @property
    def nbytes(self) -> int:
        if self.unquantized is not None:
            return self.unquantized.nbytes
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def quantized_layers(layers: list, quantization: KVQuantization | None) -> list:
    """``layers`` (from ``model.make_cache``) with every ``KVCache`` replaced by a
    ``QuantizedKVCache`` holding the same positions. Rotating caches (sliding-window
    layers) stay float: they are bounded already, and ``--max-kv-size`` with ``--kv-bits``
    is refused (``check_quantizable``). The list itself is changed and returned."""
    if quantization is None:
        return layers
    for i, layer in enumerate(layers):
        if type(layer) is KVCache:
            quantized = QuantizedKVCache(quantization)
            if layer.offset:
                quantized.update_and_fetch(*layer.state)
            layers[i] = quantized
    return layers


def check_quantizable(layers: list, quantization: KVQuantization | None, head_dim: int) -> None:
    """One-line ``UserError`` when ``quantized_layers`` could not quantize these layers."""
    if quantization is None:
        return
    quantization.check(head_dim)
    if not any(isinstance(layer, (KVCache, QuantizedKVCache)) for layer in layers):
        raise UserError("--kv-bits with --max-kv-size is not supported: a rotating cache is not quantized; "
                        "use one or the other")


class CrossAttentionCache:
    """What one decoder layer's cross-attention reads: the encoder's output (B, S, D) and
    its padding mask (broadcastable to (B, n_heads, L, S), or None). The keys and values
    (B, n_kv_heads, S, head_dim) are projected from it on first use and kept, so a whole
    decoding run projects them once per input."""

    def __init__(self, memory: mx.array, mask: mx.array | None = None):
        self.memory = memory
        self.mask = mask
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def fetch(self, project) -> tuple[mx.array, mx.array]:
        """``project(memory) -> (keys, values)`` the first time; the kept pair after."""
        if self.keys is None:
            self.keys, self.values = project(self.memory)
        return self.keys, self.values

    @property
    def state(self) -> tuple:
        return () if self.keys is None else (self.keys, self.values)
