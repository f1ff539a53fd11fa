"""``StateCache``: the cache of a layer whose memory of the past is a fixed-size state,
not keys and values (Gated DeltaNet's and Mamba-2's recurrent state, the short
convolutions' last inputs).

A recurrent layer folds every position it reads into its state, so the state has the
same size at position 10 as at 100,000, and it cannot be cut back to a shorter prefix:
``is_trimmable`` is False and whoever needs an earlier state (chat's ``/undo``,
speculative decoding's rejected drafts, the server's prefix cache) keeps a ``copy``
taken at that point.

The cache holds a list of arrays whose meaning its layer kind defines (for example
``[conv_state, recurrent_state]``), each with the batch on axis 0, and ``offset``, the
number of positions folded in, which the layer advances (``advance``) as attention's
``update_and_fetch`` advances a KV cache.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError


class StateCache:
    """``size`` state arrays of one layer (None until the layer first writes them)."""

    def __init__(self, size: int):
        self.arrays: list[mx.array | None] = [None] * size
        self.offset = 0

    def __getitem__(self, index: int) -> mx.array | None:
        return self.arrays[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.arrays[index] = value

    def advance(self, length: int) -> None:
        """Count ``length`` more positions as folded into the state."""
        self.offset += length

    def reserve(self, positions: int) -> None:
        """As ``KVCache.reserve``; a fixed-size state has nothing to reserve."""

    def make_mask(self, length: int, window: int | None = None):
        """No mask: a recurrent layer reads its inputs in order, causal by construction."""
        return None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        """A state cannot forget its last ``n`` positions: refused (callers that rewind keep
        a ``copy`` instead)."""
        if n == 0:
            return 0
        raise UserError("a recurrent layer's state cannot be trimmed back to an earlier position")

    def copy(self) -> "StateCache":
        """An independent snapshot: new array objects (a layer may update its state in
        place, ``cache[0][..., i] = ...``, which must not reach the snapshot) over the same
        values, so no data is copied until one side changes."""
        twin = StateCache(len(self.arrays))
        twin.arrays = [None if a is None else mx.array(a) for a in self.arrays]
        twin.offset = self.offset
        return twin

    @property
    def state(self) -> tuple:
        return () if any(a is None for a in self.arrays) else tuple(self.arrays)

    @state.setter
    def state(self, value) -> None:
        self.arrays = list(value)

    @property
    def meta_state(self) -> dict:
        return {"kind": "StateCache", "size": len(self.arrays), "offset": self.offset}

    @meta_state.setter
    def meta_state(self, meta: dict) -> None:
        self.offset = int(meta["offset"])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)
