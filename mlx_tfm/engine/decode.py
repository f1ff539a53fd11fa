"""The decoding pipeline: every round, one decoding step for the whole batch. Every row
feeds one token, at its own position, through one forward pass (``BatchCache``: per-row
offsets and masks), and gets its next token from its own sampling settings, processors
and random stream (``sample_rows``).

A step is queued before the previous one's tokens are handed out: MLX computes it while
the engine thread detokenizes and sends the last one (as ``generate_step`` does).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..generation.sampling import SamplingRows, log_normalizer, sample_rows
from .batch_cache import BatchCache
from .outputs import Outputs
from .rows import Row, RowBatch, mrope_inputs

log = logging.getLogger("mlx_tfm.engine")


@dataclass
class DecodeStep:
    """A decoding step queued for ``rows``: its outputs, computed or still being computed."""

    rows: list[Row]
    tokens: mx.array  # (B,)
    logprobs: mx.array  # (B,) of the chosen tokens
    log_norms: mx.array  # (B,) log-sum-exp of the logits; NaN when the logits were
    top: tuple  # () or (top logprobs (B, k), their ids (B, k))


def top_logprobs(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest log-probabilities of each row and their token ids, (B, k) each,
    most probable first."""
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)


class DecodePipeline:
    """The decoding batch of ``model``: its rows and caches, their sampling settings and
    keys as arrays, and the step in flight. A finished row leaves the batch as soon as
    its last token is handed out, after ``remember(row, caches, index)`` unless it failed."""

    def __init__(self, model, kinds: list[BatchCache], outputs: Outputs,
                 remember: Callable[[Row, list[BatchCache], int], None]):
        self.model = model
        self.outputs = outputs
        self.remember = remember
        self.batch = RowBatch(kinds)
        self.sampling: SamplingRows | None = None  # of the batch's rows; None: rebuild
        self.keys: mx.array | None = None  # (B, 2) the rows' random keys
        self.in_flight: DecodeStep | None = None  # queued last round, collected next round

    def join(self, rows: list[Row], caches: list[BatchCache]) -> None:
        """Rows whose prompt is in join after the running ones."""
        self._store_keys()
        self.batch.add(rows, [[layer] for layer in caches])
        self.sampling = None

    def step(self) -> None:
        """Queue the next decoding step, then hand out the tokens of the one queued in the
        previous round. The next step feeds the previous one's tokens without waiting for
        their values, so a row that finishes there computes one step more, never shown.
        Rows with logits processors need every token's value first: then each step is
        collected at once."""
        previous, self.in_flight = self.in_flight, None
        in_order = any(r.processors for r in self.batch.rows)
        if previous is not None and (in_order or not self._can_follow(previous)):
            self._collect(previous)
            previous = None
        step = self._queue(previous) if self.batch.rows else None
        if previous is not None:
            self._collect(previous)
        if step is not None and in_order:
            self._collect(step)
        elif step is not None:
            self.in_flight = step

    def _can_follow(self, previous: DecodeStep) -> bool:
        """Whether the running rows are the previous step's (finished ones gone), newcomers
        after them: then its tokens feed the next step unread."""
        carried = {r.id for r in previous.rows}
        rows = self.batch.rows
        n = sum(r.id in carried for r in rows)
        return all(r.id in carried for r in rows[:n])

    def _queue(self, previous: DecodeStep | None) -> DecodeStep | None:
        """Build one forward pass and sampling for every running row and start computing it."""
        rows = self.batch.rows
        try:
            if self.sampling is None:
                self.sampling = SamplingRows([r.settings for r in rows])
                self.keys = mx.stack([r.key for r in rows])
            positions = mrope_inputs(rows, 1)  # Qwen's image rows: each at its own M-RoPE position
            logits = self.model(self._inputs(rows, previous), cache=self.batch.caches, **positions)[:, -1, :]  # (B, V)
            for row in rows:
                row.fed += 1
            logits = self._process(rows, self.sampling.add_logit_bias(logits))
            log_norm = log_normalizer(logits)[:, 0]  # (B,)
            logprobs = logits - log_norm[:, None]
            tokens, keys = sample_rows(logprobs, self.sampling, self.keys)
            chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
            k = max(r.request.top_logprobs for r in rows)
            top = top_logprobs(logprobs, k) if k else ()
            mx.async_eval(tokens, keys, chosen, log_norm, *top)
        except Exception as error:
            self.fail_all(error)
            return None
        self.keys = keys
        return DecodeStep(list(rows), tokens, chosen, log_norm, top)

    @staticmethod
    def _inputs(rows: list[Row], previous: DecodeStep | None) -> mx.array:
        """The token each row feeds, (B, 1): the previous step's output (not yet read) for
        the rows it had, the last prompt token for rows that just joined."""
        if previous is None:
            return mx.array([r.tokens[r.fed] for r in rows])[:, None]
        position = {r.id: i for i, r in enumerate(previous.rows)}
        carried = [position[r.id] for r in rows if r.id in position]
        fresh = [r.tokens[r.fed] for r in rows if r.id not in position]
        parts = []
        if carried:
            same = carried == list(range(len(previous.rows)))
            parts.append(previous.tokens if same else previous.tokens[mx.array(carried)])
        if fresh:
            parts.append(mx.array(fresh, dtype=previous.tokens.dtype))
        return mx.concatenate(parts)[:, None]

    def _process(self, rows: list[Row], logits: mx.array) -> mx.array:
        """Each row's processors on its own logits (1, V); a processor that raises fails only
        its row."""
        if not any(r.processors for r in rows):
            return logits
        processed = []
        for i, row in enumerate(rows):
            row_logits = logits[i : i + 1]
            if row.processors:
                try:
                    context = mx.array(row.tokens[: row.fed + 1])  # (L,) every token so far
                    for processor in row.processors:
                        row_logits = processor(context, row_logits)
                    if row_logits.shape != (1, logits.shape[-1]):
                        raise ValueError(f"a logits processor returned shape {row_logits.shape}")
                except Exception as error:
                    log.exception("logits processor failed")
                    self.outputs.fail([row], error)
                    row_logits = logits[i : i + 1]
            processed.append(row_logits.astype(logits.dtype))
        return mx.concatenate(processed)

    def _collect(self, step: DecodeStep) -> None:
        """Wait for a queued step and hand out its tokens; finished rows leave the batch."""
        try:
            tokens, chosen, log_norms = step.tokens.tolist(), step.logprobs.tolist(), step.log_norms.tolist()
            alternatives = [None] * len(step.rows)
            if step.top:
                values, ids = step.top[0].tolist(), step.top[1].tolist()
                alternatives = [list(zip(ids[i][: r.request.top_logprobs], values[i][: r.request.top_logprobs]))
                                for i, r in enumerate(step.rows)]
        except Exception as error:
            self.fail_all(error, step.rows)
            return
        generated = 0
        for i, row in enumerate(step.rows):
            if row.finish_reason is not None:  # cancelled, failed, or finished a step earlier
                continue
            if math.isnan(log_norms[i]):
                self.outputs.fail([row], "the model produced NaN logits")
                continue
            self.outputs.token(row, tokens[i], chosen[i], alternatives[i])
            generated += 1
        self.outputs.generated(generated)
        self.remove_finished()

    def remove_finished(self) -> None:
        """Finished rows leave the batch (``RowBatch.remove_finished``)."""
        if any(row.finish_reason is not None for row in self.batch.rows):
            self._store_keys()
            self.batch.remove_finished(self.remember)
            self.sampling = None

    def fail_all(self, error: Exception, rows: list[Row] = ()) -> None:
        """A decoding step raised: every row of the batch fails (and ``rows``); prefilling
        and waiting requests go on."""
        log.error("decoding step failed", exc_info=error)
        self.outputs.fail(list(rows) + self.batch.rows, error)
        self.reset()

    def reset(self) -> None:
        self.batch.clear()
        self.sampling = self.keys = self.in_flight = None

    def _store_keys(self) -> None:
        """Give each running row its current key back before the batch changes."""
        if self.sampling is not None and self.keys is not None:
            for i, row in enumerate(self.batch.rows):
                row.key = self.keys[i]


__all__ = ["DecodePipeline", "DecodeStep", "top_logprobs"]
