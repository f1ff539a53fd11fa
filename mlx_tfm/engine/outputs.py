"""What the engine hands back: each row's events (text pieces with stop strings held back
and removed, logprobs, finish reasons, one-line errors) and the counts ``metrics()``
reports. Text goes through the same ``TextPieces`` as ``stream_generate``."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..errors import UserError
from .requests import Event
from .rows import Row

log = logging.getLogger("mlx_tfm.engine")
# generation_tps in metrics() counts the tokens of the last this many seconds
TPS_WINDOW_S = 10.0


def one_line(error: BaseException) -> str:
    if isinstance(error, UserError):
        return str(error).splitlines()[0] if str(error) else "invalid request"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Outputs:
    """Sends the rows' events and counts them. The engine thread writes; ``counts()``
    may be read from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals = {"prompt_tokens_total": 0, "generation_tokens_total": 0}
        self._finished: dict[str, int] = {}  # requests by finish reason
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last TPS_WINDOW_S

    def admitted(self, row: Row) -> None:
        with self._lock:
            self._totals["prompt_tokens_total"] += row.prompt_length

    def token(self, row: Row, token: int, logprob: float, alternatives) -> None:
        """The row's next token: its text, and its last event when it finishes there."""
        row.generated += 1
        row.tokens.append(token)
        text, finish_reason = row.pieces.add(token)
        if finish_reason is None and row.generated >= row.max_tokens:
            tail, finish_reason = row.pieces.finish()
            text += tail
        event = row.event(token, text, finish_reason, logprob if row.request.logprobs else None,
                          alternatives if row.request.top_logprobs else None)
        if finish_reason is not None:
            self.finish(row, event)
        else:
            self.emit(row, event)

    def generated(self, n: int) -> None:
        """One decoding step handed out ``n`` tokens."""
        with self._lock:
            self._totals["generation_tokens_total"] += n
            now = time.perf_counter()
            self._recent.append((now, n))
            while self._recent and now - self._recent[0][0] > TPS_WINDOW_S:
                self._recent.popleft()

    def emit(self, row: Row, event: Event) -> None:
        try:
            row.on_event(event)
        except Exception:  # the receiver is gone: free the row, no more events
            log.exception("on_event failed for request %d; dropping it", row.id)
            if row.finish_reason is None:
                row.finish_reason = "cancelled"

    def finish(self, row: Row, event: Event) -> None:
        row.finish_reason = event.finish_reason
        with self._lock:
            self._finished[event.finish_reason] = self._finished.get(event.finish_reason, 0) + 1
        self.emit(row, event)

    def cancel(self, row: Row) -> None:
        self.finish(row, row.event(None, "", "cancelled"))

    def fail(self, rows: list[Row], error: BaseException | str) -> None:
        """Every unfinished row of ``rows`` ends with one "error" event."""
        message = error if isinstance(error, str) else one_line(error)
        internal = not isinstance(error, (str, UserError))  # an unexpected exception, not the engine's own words
        for row in rows:
            if row.finish_reason is None:
                self.finish(row, row.event(None, "", "error", error=message, internal=internal))

    def counts(self) -> dict:
        """The token totals, ``generation_tps`` over the last ``TPS_WINDOW_S`` and
        ``requests_total`` by finish reason."""
        with self._lock:
            recent, totals, finished = list(self._recent), dict(self._totals), dict(self._finished)
        span = max(time.perf_counter() - recent[0][0], 1.0) if recent else 1.0
        return {**totals, "generation_tps": sum(n for _, n in recent) / span, "requests_total": finished}


__all__ = ["Outputs", "one_line"]
