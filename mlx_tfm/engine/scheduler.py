"""Admission and prefill: which waiting requests join the *prefill group*, and the chunk of
their prompts each round feeds.

Waiting requests join while the batch has room (and, while streams are running, while the
prompt tokens left to read fit one prefill step); each reuses the longest prefix the
shared prefix cache holds. One chunk of prompt then runs through the group: all its rows
together, each feeding up to the same number of its own tokens, a row with fewer left
padded so that prompts of unequal length finish in one pass; ``prefill_step_size`` tokens
in all, so one forward pass's memory is bounded and running streams keep flowing while
long prompts are read. A row whose prompt is in (all but its last token, which its first
decoding step feeds) leaves the group for the decoding batch.

Recurrent layers (``BatchStateCache``) fold every input in: their rows are never padded,
and since their state cannot be cut back later, chunks stop at every
``SNAPSHOT_INTERVAL``-th prompt position of a row and at its prompt's end, where the row
keeps a snapshot of its states (``Row.snapshots``) for the prefix cache.
"""

from __future__ import annotations

import logging
from collections import deque

import mlx.core as mx

from ..cpu.switch import prompt_layer_by_layer
from .batch_cache import BatchCache
from .batch_state_cache import row_states
from .outputs import Outputs
from .prefix_cache import PrefixCache
from .rows import Row, RowBatch, mrope_inputs

log = logging.getLogger("mlx_tfm.engine")
MAX_PADDING_SHARE = 0.25  # of a prefill chunk's positions (see chunk_length)
PAD_TOKEN = 0  # what a padded position feeds; its keys and values are never visible
SNAPSHOT_INTERVAL = 256  # prompt positions between snapshots of a row's recurrent states


def chunk_length(pending: list[int], per_row: int, max_padding_share: float = MAX_PADDING_SHARE) -> int:
    """How many tokens a prefill chunk feeds each row (rows with fewer left are padded):
    the most that keeps padding within ``max_padding_share`` of the chunk. A forward pass
    reads every weight whatever its length, so finishing the prompts of unequal length
    together beats a pass for each remainder; the shortest remainder never pads."""
    for length in sorted({min(p, per_row) for p in pending}, reverse=True):
        padding = sum(length - min(p, length) for p in pending)
        if padding <= max_padding_share * length * len(pending):
            return length
    raise AssertionError("unreachable: the shortest remainder needs no padding")


class Scheduler:
    """The waiting requests and the prefill group, over ``model`` with one empty batched
    cache per layer in ``kinds``."""

    def __init__(self, model, kinds: list[BatchCache], outputs: Outputs, prefill_step_size: int):
        self.model = model
        self.kinds = kinds
        self.outputs = outputs
        self.prefill_step_size = prefill_step_size
        self.waiting: deque[Row] = deque()
        self.group = RowBatch(kinds)
        args = model.args
        # Learned position embeddings have one row per position: a padded chunk's positions,
        # padding included, must stay inside the table.
        self.learned_positions = (args.max_position_embeddings - args.position_offset
                                  if args.position_embedding == "learned" else None)
        self.recurrent = not all(kind.takes_padding for kind in kinds)
        self.max_padding_share = 0.0 if self.recurrent else MAX_PADDING_SHARE

    def admit(self, prefix_cache: PrefixCache, room: int, streams_running: bool) -> None:
        """Waiting requests join the prefill group while there is ``room`` (rows the batch
        may still take). While streams are running, only as long as the group's prompt
        tokens still to read fit one prefill step (a first row always joins), so that a
        few prompts are read whole between decoding steps; with no stream to keep flowing,
        every request that fits joins and their prompts are read together (the last first
        token comes soonest)."""
        rows, caches = [], []  # per admitted row, its cache per layer: they join the group together
        budget = sum(r.pending for r in self.group.rows)
        while self.waiting and len(rows) < room:
            row = self.waiting[0]
            limit = row.prompt_length - 1
            budget += limit - prefix_cache.find(row.cache_keys, limit=limit)[1]
            if (self.group.rows or rows) and streams_running and budget > self.prefill_step_size:
                break
            self.waiting.popleft()
            caches.append(self._row_caches(row, prefix_cache))
            rows.append(row)
            self.outputs.admitted(row)
        self.group.add(rows, [list(layer) for layer in zip(*caches)])

    def _row_caches(self, row: Row, prefix_cache: PrefixCache) -> list[BatchCache]:
        """The row's batched cache per layer, from the longest prefix the prefix cache holds."""
        entry, cached = prefix_cache.lookup(row.cache_keys, limit=row.prompt_length - 1)
        if entry is not None:
            caches = [kind.row_from(single, cached) for kind, single in zip(self.kinds, entry.layers_at(cached))]
        else:
            caches = None
        if caches is None or None in caches:  # nothing cached, or a layer that cannot start from that prefix
            cached = 0
            caches = [kind.row_from(None, 0) for kind in self.kinds]
        row.cached_tokens = row.fed = cached
        return caches

    def prefill_chunk(self) -> None:
        """Feed every row of the group the same number of its next prompt tokens, at most
        ``prefill_step_size`` in all (the rows whose prompt is in have left already)."""
        rows = self.group.rows
        if not rows:
            return
        per_row = max(1, self.prefill_step_size // len(rows))
        if self.learned_positions is not None:
            per_row = max(1, min(per_row, *(self.learned_positions - r.fed for r in rows)))
        length = chunk_length([r.pending for r in rows], per_row, self.max_padding_share)
        if self.recurrent:  # stop at the next snapshot position of any row
            length = min(length, *(SNAPSHOT_INTERVAL - r.fed % SNAPSHOT_INTERVAL for r in rows))
        feeds = [min(r.pending, length) for r in rows]
        chunk = mx.array([r.tokens[r.fed : r.fed + n] + [PAD_TOKEN] * (length - n)
                          for r, n in zip(rows, feeds)])  # (G, length), each row padded at its end
        try:
            features = [r.chunk_features(self.model, r.fed, r.fed + n) for r, n in zip(rows, feeds)]
            features = [f for f in features if f is not None]  # row by row, as the chunk's image tokens come
            images = {"image_features": mx.concatenate(features)} if features else {}
            with prompt_layer_by_layer():
                self.model(chunk, cache=self.group.caches, **images, **mrope_inputs(rows, length))
            for layer in self.group.caches:
                layer.drop_padding([length - n for n in feeds])
            mx.eval([layer.state for layer in self.group.caches])
        except Exception as error:
            log.exception("prefill failed")
            self.outputs.fail(rows, error)
            self.group.clear()
            return
        for index, (row, n) in enumerate(zip(rows, feeds)):
            row.fed += n
            if self.recurrent and (row.prefilled or row.fed % SNAPSHOT_INTERVAL == 0):
                row.snapshots[row.fed] = row_states(self.group.caches, index)

    def take_prefilled(self) -> tuple[list[Row], list[BatchCache]] | None:
        """The rows whose prompt is in, with their caches, out of the group (None: none)."""
        ready = [i for i, row in enumerate(self.group.rows) if row.prefilled]
        return self.group.take(ready) if ready else None

    @property
    def unfinished(self) -> list[Row]:
        """The waiting rows, then the group's."""
        return list(self.waiting) + self.group.rows


__all__ = ["Scheduler", "chunk_length"]
