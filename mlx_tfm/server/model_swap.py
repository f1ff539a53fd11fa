"""One model at a time, switched on request (as Ollama does): with ``--model-dir DIR``
the server lists every model folder in DIR on ``/v1/models`` (and Ollama's ``/api/tags``),
and a request naming one that is not loaded swaps it in, on every API: OpenAI's chat,
completions, embeddings, rerank and Responses, Ollama's chat, generate and embed (its show reads a folder, loading nothing),
Anthropic's messages and count_tokens (``serving_of``). A failure is each API's own error
body, as its handler's other failures are.

A swap runs on a thread of its own, one at a time: new requests wait for it; the old
model's requests get ``DRAIN_SECONDS`` to finish (those still running after that end
with an error event), its engine stops, then the new model loads. A request waits at
most ``LOAD_WAIT_SECONDS`` for the load (then a 503 "still loading: retry"), and a model
whose weights are larger than the free memory (plus what the old model gives back) is
refused with a 507 before anything is unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path

from .errors import APIError
from .workers import in_worker

log = logging.getLogger("mlx_tfm.server")

DRAIN_SECONDS = 30.0  # the old model's running requests get this long to finish
LOAD_WAIT_SECONDS = 120.0  # a request waits this long for the model it names to load


def local_models(model_dir: str | Path) -> dict[str, Path]:
    """The model folders directly in ``model_dir``, by the id clients name them with (the folder's name)."""
    from ..weights.catalog import looks_like_a_model

    folder = Path(model_dir).expanduser()
    return {path.name: path for path in sorted(folder.iterdir()) if looks_like_a_model(path)}


def weights_bytes(folder: Path) -> int:
    """What loading the folder takes at least: the size of its weight files."""
    from ..weights.catalog import weight_files

    return sum(path.stat().st_size for path in weight_files(folder))


def free_memory_bytes() -> int | None:
    """Memory the system can still give (Linux: available pages; elsewhere MLX's device
    memory less what MLX holds); None when it cannot be told."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pass
    import mlx.core as mx

    total = mx.device_info().get("memory_size")
    return None if not total else int(total) - mx.get_active_memory()


def requested_model(body: bytes) -> str | None:
    """The ``model`` a request body names (None when it names none or is not JSON: the
    handler then answers as it does without swapping)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else None


class ModelSwap:
    """The switching part of a ``ServerState``: which local models there are, and the swap.

    Every request holds a lease on the serving it was given until its rows are in the
    engine (``lease``); a swap unloads a model only once its leases are returned and its
    engine is idle (or ``DRAIN_SECONDS`` passed). Requests waiting for a swap are granted
    their leases by the swap itself, so the next swap cannot unload the model under them
    before they resume."""

    def __init__(self, state, model_dir: str | Path, loader, free_memory=free_memory_bytes):
        self.state = state
        self.loader = loader  # settings -> Serving (app.load_serving)
        self.model_dir = Path(model_dir).expanduser()
        self.free_memory = free_memory
        self._lock = threading.Lock()  # one swap at a time
        self._held = threading.Condition()  # guards the leases, the waiting and state.serving's replacement
        self._leases: dict[int, int] = {}  # id(serving) -> requests using it
        self._waiting: dict[str, list] = {}  # model name -> tokens of the requests waiting for its swap
        self._granted: dict[int, object] = {}  # id(token) -> the serving its swap leased to it
        self._swapping: dict[str, asyncio.Future] = {}

    def available(self) -> dict[str, Path]:
        return local_models(self.model_dir)

    def cards(self) -> list[dict]:
        """The /v1/models entries of the local models that are not loaded."""
        return [{"id": name, "object": "model", "created": int(path.stat().st_mtime), "owned_by": "mlx-tfm",
                 "status": "available"} for name, path in self.available().items() if name != self.state.model_id]

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None):
        """The serving of the model ``name`` names (the loaded one, or a local one swapped
        in), held until the block ends."""
        serving = await self.acquire(name)
        try:
            yield serving
        finally:
            self._release(serving)

    def _release(self, serving) -> None:
        with self._held:
            if id(serving) in self._leases:  # (gone when the drain ran out of time)
                self._leases[id(serving)] -= 1
            self._held.notify_all()

    def _take(self):
        """Lease the loaded serving (called holding ``_held``)."""
        serving = self.state.ready_serving()
        self._leases[id(serving)] = self._leases.get(id(serving), 0) + 1
        return serving

    async def acquire(self, name: str | None):
        with self._held:
            if name is None or name not in self.available():
                return self._take()  # another name is the handler's 404
            if name == self.state.model_id and not self._lock.locked():
                return self._take()  # (during a swap, even the old model's name waits its turn)
            token = object()
            self._waiting.setdefault(name, []).append(token)
        future = self._swapping.get(name)
        if future is None or future.done():
            future = asyncio.ensure_future(in_worker(self.swap_to, name))
            self._swapping[name] = future
        try:
            await asyncio.wait_for(asyncio.shield(future), LOAD_WAIT_SECONDS)
        except BaseException as e:
            self._give_up(name, token)
            if isinstance(e, asyncio.TimeoutError):
                raise APIError(503, f"the model {name!r} is still loading: retry shortly",
                               code="model_not_ready") from None
            raise
        with self._held:
            return self._granted.pop(id(token))

    def _give_up(self, name: str, token) -> None:
        """A request that stops waiting: out of the queue, its lease back if it was granted one."""
        with self._held:
            if token in self._waiting.get(name, []):
                self._waiting[name].remove(token)
            serving = self._granted.pop(id(token), None)
        if serving is not None:
            self._release(serving)

    def swap_to(self, name: str) -> None:
        """Unload the current model and load ``name`` in its place (runs on a worker thread);
        then lease it to every request waiting for it."""
        with self._lock:
            if name != self.state.model_id:  # another request may have swapped it in meanwhile
                folder = self.available()[name]
                self.check_memory(name, folder)
                started = time.monotonic()
                self.unload()
                self.load(name, folder)
                log.info("swapped in %s in %.1f s", name, time.monotonic() - started)
            with self._held:
                for token in self._waiting.pop(name, []):
                    self._granted[id(token)] = self._take()

    def check_memory(self, name: str, folder: Path) -> None:
        free = self.free_memory()
        needed = weights_bytes(folder)
        current = self.available().get(self.state.model_id)
        freed = weights_bytes(current) if current is not None else 0
        if free is not None and needed > free + freed:
            raise APIError(507, f"not enough memory to load {name!r}: its weights take {needed / 1e9:.2f} GB and "
                                f"{(free + freed) / 1e9:.2f} GB would be free", code="insufficient_memory")

    def unload(self) -> None:
        """Wait (up to DRAIN_SECONDS) until the old model's leases are back and its engine is
        idle, then stop its engine (requests still running get an error event)."""
        serving = self.state.serving
        if serving is None:
            return
        engine = getattr(serving, "engine", None)  # encoders have none
        deadline = time.monotonic() + DRAIN_SECONDS
        with self._held:
            while not self._drained(serving, engine) and time.monotonic() < deadline:
                self._held.wait(0.05)
            self.state.serving = None
            self._leases.pop(id(serving), None)
        serving.stopping.set()
        if engine is not None:
            engine.stop()

    def _drained(self, serving, engine) -> bool:
        if self._leases.get(id(serving), 0):
            return False
        counts = engine.metrics() if engine is not None else {"running": 0, "waiting": 0}
        return counts["running"] + counts["waiting"] == 0

    def load(self, name: str, folder: Path) -> None:
        """Load ``name``; should it fail, load the previous model back and report the failure."""
        previous = self.state.settings
        settings = dataclasses.replace(previous, model=str(folder))
        try:
            self.state.serving = self.loader(settings)
        except Exception as e:
            log.warning("loading %s failed, the previous model comes back", name, exc_info=True)
            self.state.serving = self.loader(previous)
            raise APIError(500, f"could not load the model {name!r}: {e}", code="model_load_failed") from None
        self.state.settings, self.state.model_id = settings, name


@contextlib.asynccontextmanager
async def serving_of(state, name: str | None):
    """The serving of the model ``name`` names, held while the block submits the request:
    swapped in when the server has a ``--model-dir`` and ``name`` is one of its models,
    else the loaded one. Every API's handler goes through here (each with its own way of
    naming the model: Ollama's ``:latest`` tag, Anthropic's required ``model``)."""
    if state.swap is None:
        yield state.ready_serving()
        return
    async with state.swap.lease(name) as serving:
        yield serving


def serving_named(state, body: bytes):
    """``serving_of`` the model a request body's ``model`` field names (OpenAI's APIs)."""
    return serving_of(state, requested_model(body))
