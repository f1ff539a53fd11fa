"""MLX's streams are per thread (MLX 0.32): a thread that evaluates gets its own default
stream, run by a thread of MLX's own, and a thread that ends without freeing its streams
makes the process abort at exit about half the time ("terminate called without an active
exception", status -6; mlx PR #4373). So every thread of ours that runs MLX work frees them
when the work is done: the engine thread when it stops, the server's workers (asyncio's
pool, whose threads we cannot follow to their end) after each job.

Arrays cannot cross threads unevaluated anyway (another thread has no such stream), so
freeing a worker's streams after a job that returned evaluated results loses nothing."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import mlx.core as mx

Result = TypeVar("Result")


def release_thread_streams() -> None:
    """Wait for this thread's queued MLX work, then free its streams."""
    try:
        mx.synchronize()
    finally:
        mx.clear_streams()


def fresh_default_streams() -> None:
    """New default streams for this thread: once its streams are freed, MLX does not make
    them again (the next operation fails: "There is no Stream(cpu, 0) in current thread")."""
    for device_type in {mx.cpu, mx.default_device().type}:  # the CPU's, and the GPU's where it is the default
        mx.set_default_stream(mx.new_stream(device_type))


def releasing_streams(work: Callable[..., Result]) -> Callable[..., Result]:
    """``work`` run on fresh default streams, which are freed when it returns or raises."""

    @functools.wraps(work)
    def run(*args, **kwargs) -> Result:
        fresh_default_streams()
        try:
            return work(*args, **kwargs)
        finally:
            release_thread_streams()

    return run
