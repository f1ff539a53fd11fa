"""The asyncio side of the engine. ``Engine.submit`` calls ``on_event`` from the engine's
thread; each event is handed to the event loop with ``call_soon_threadsafe`` and queued
for the request that is waiting for it. A ``Generation`` is the rows (engine requests) of
one HTTP request: ``n`` choices, or one per legacy prompt."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from .errors import APIError


class Generation:
    """Submits its rows at once and yields ``(row, event)`` as events arrive, until every
    row has finished; ``cancel()`` frees the rows still running (a client that left)."""

    def __init__(self, engine, requests: list):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running: dict[int, int] = {}  # row -> engine request id
        try:
            for row, request in enumerate(requests):
                self._running[row] = engine.submit(request, self._deliverer(row))
        except Exception:
            self.cancel()
            raise APIError(503, "the server is shutting down", code="server_shutting_down") from None

    def _deliverer(self, row: int):
        def deliver(event) -> None:  # runs on the engine's thread
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (row, event))
            except RuntimeError:  # the event loop is closed: the server has stopped
                pass

        return deliver

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        while self._running:
            row, event = await self._queue.get()
            if event.finish_reason is not None:
                self._running.pop(row, None)
            yield row, event

    def cancel(self) -> None:
        for request_id in self._running.values():
            self._engine.cancel(request_id)
        self._running.clear()
