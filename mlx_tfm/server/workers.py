"""Blocking work of the handlers (tokenizing a prompt, an encoder's forward pass, loading
a model) runs on asyncio's worker threads; each job frees its thread's MLX streams when it
ends (engine/threads.py says why)."""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

from ..engine.threads import releasing_streams

Result = TypeVar("Result")


async def in_worker(work: Callable[..., Result], *args) -> Result:
    """``await`` ``work(*args)`` run on a worker thread."""
    return await asyncio.to_thread(releasing_streams(work), *args)
