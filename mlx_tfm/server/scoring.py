"""Scoring a prompt: the logprob of each of its tokens given the ones before it, and the
most likely alternatives at each position. ``/v1/completions`` with ``echo`` and
``logprobs`` reports them for the echoed prompt (``max_tokens: 0`` is how evaluation
harnesses score a text: the prompt's logprobs, nothing generated).

The model's forward pass runs on the request's worker thread, beside the engine's own
thread (the weights are only read); a lock keeps scoring passes one at a time."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import mlx.core as mx

SCORE_CHUNK = 256  # positions per forward pass: a (1, chunk, vocab) float32 block at most


@dataclass(frozen=True)
class TokenScore:
    """One prompt token: its logprob (None for the first, which nothing predicts) and the
    ``top`` alternatives at its position, (token id, logprob), most likely first."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] | None


class PromptScorer:
    """``scorer(ids, top)`` -> one ``TokenScore`` per id of the prompt."""

    def __init__(self, model):
        self.model = model
        self._lock = threading.Lock()

    def __call__(self, ids: list[int], top: int) -> list[TokenScore]:
        with self._lock:
            logprobs, tops = self._score(ids, top)
        first = TokenScore(ids[0], None, None)
        return [first] + [TokenScore(token, value, alternatives)
                          for token, value, alternatives in zip(ids[1:], logprobs, tops)]

    def _score(self, ids: list[int], top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Logprobs of ids[1:] and the top alternatives at each of their positions."""
        cache = self.model.make_cache()
        tokens = mx.array(ids)
        logprobs, tops = [], []
        for start in range(0, len(ids) - 1, SCORE_CHUNK):
            inputs = tokens[start : start + SCORE_CHUNK]
            targets = tokens[start + 1 : start + 1 + SCORE_CHUNK]
            logits = self.model(inputs[None], cache=cache)[0, : targets.shape[0]].astype(mx.float32)  # (chunk, V)
            normalized = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(normalized, targets[:, None], axis=-1)[:, 0]  # (chunk,)
            logprobs += picked.tolist()
            tops += top_alternatives(normalized, top)
        return logprobs, tops


def top_alternatives(logprobs: mx.array, top: int) -> list[list[tuple[int, float]]]:
    """The ``top`` most likely (id, logprob) of each row of ``logprobs`` (L, V)."""
    if top == 0:
        return [[] for _ in range(logprobs.shape[0])]
    ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]  # (L, top), unordered
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)  # most likely first
    ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    return [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
