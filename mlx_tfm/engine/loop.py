"""The generation engine behind ``mlx-tfm server`` and ``mlx_tfm.batch_generate``:
continuous batching with a prefix cache shared across requests.

Every round of the engine (``Engine.step``):

1. takes in new requests and cancellations (a cancelled row is gone before the next
   forward pass);
2. admits waiting requests into the prefill group and runs one chunk of their prompts
   (``Scheduler``, scheduler.py); rows whose prompt is in join the decoding batch;
3. runs one decoding step for the whole batch (``DecodePipeline``, decode.py). Rows that
   finish (EOS, a stop string, their token limit, an error) leave; their cache goes to
   the shared prefix cache (``PrefixCache``) and the batch is compacted.

Events (text pieces, logprobs, finish reasons) are made in outputs.py, the rows in
rows.py; the engine reaches every layer's cache only through ``BatchCache``
(batch_cache.py). A row feeds the last token of its prompt in its first decoding step,
so the batch always feeds exactly one token per row.

The interface (``SamplingParams``, ``Request``, ``Event``, ``Engine``, ``batch_generate``) is
the one documented for the HTTP layer in the project notes (ENGINE_API.md).
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from itertools import count
from typing import Callable

import mlx.core as mx

from ..errors import UserError
from ..generation.step import check_vocabulary, encode_prompt
from ..generation.token_cache import TokenCache
from ..model.chunk_bound import chunk_bounded
from .batch_cache import BatchCache, batch_cache_for
from .batch_chunked_cache import BatchChunkedKVCache  # noqa: F401  (registers the batched cache of chunked layers)
from .batch_state_cache import BatchStateCache  # noqa: F401  (registers the batched cache of recurrent layers)
from .decode import DecodePipeline
from .outputs import Outputs
from .prefix_cache import PrefixCache
from .requests import Event, Request, SamplingParams
from .rows import Row
from .scheduler import Scheduler
from .threads import release_thread_streams

log = logging.getLogger("mlx_tfm.engine")


class Engine:
    """Continuous batching over one model; see the module docstring. Drive it with
    ``start()`` (one thread that owns MLX) or synchronously with ``step()``."""

    def __init__(self, model, tokenizer, *, max_batch: int = 16, prefill_step_size: int = 2048,
                 prompt_cache_bytes: int = 1 << 30, max_kv_size: int | None = None):
        check_vocabulary(model, tokenizer)
        if max_batch < 1 or prefill_step_size < 1 or prompt_cache_bytes < 0:
            raise UserError(f"--max-batch ({max_batch}) and --prefill-step-size ({prefill_step_size}) must be at "
                            f"least 1, --prompt-cache-bytes ({prompt_cache_bytes}) at least 0")
        if max_kv_size is not None and max_kv_size < 2:
            raise UserError(f"--max-kv-size must be at least 2, got {max_kv_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_kv_size = max_kv_size
        self.prefix_cache = PrefixCache(prompt_cache_bytes)
        self._single_caches = self._new_layers()  # context_room reads their kind
        kinds = [batch_cache_for(layer) for layer in self._new_layers()]
        self.outputs = Outputs()
        self.scheduler = Scheduler(model, kinds, self.outputs, prefill_step_size)
        self.decoder = DecodePipeline(model, kinds, self.outputs, self._remember)
        self._ids = count(1)
        self._entropy = random.SystemRandom()
        self._lock = threading.Condition()
        self._incoming: deque[Row] = deque()
        self._cancelled: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- the thread-safe interface ------------------------------------------------------------
    def start(self) -> None:
        """Start the one generation thread, which owns MLX from now on."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._thread = threading.Thread(target=self._run, name="mlx-tfm-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> int:
        """Queue ``request``; ``on_event`` is called from the engine thread for every event."""
        with self._lock:
            request_id = next(self._ids)
            row = Row(request_id, request, on_event)
            if self._stopping:
                stopped = row.event(None, "", "error", error="server shutting down")
            else:
                self._incoming.append(row)
                self._lock.notify()
                return request_id
        on_event(stopped)
        return request_id

    def cancel(self, request_id: int) -> None:
        """Free the request's row before the next step; it gets a "cancelled" event."""
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    def stop(self) -> None:
        """End every request with an "error" event ("server shutting down"); join the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._shut_down()

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def metrics(self) -> dict:
        counts = self.outputs.counts()
        return {
            "running": len(self._running) + len(self._prefilling),
            "waiting": len(self._waiting) + len(self._incoming),
            "prompt_tokens_total": counts["prompt_tokens_total"],
            "generation_tokens_total": counts["generation_tokens_total"],
            "generation_tps": counts["generation_tps"],
            "prompt_cache_hits": self.prefix_cache.hits,
            "prompt_cache_misses": self.prefix_cache.misses,
            "prompt_cache_bytes": self.prefix_cache.nbytes,
            "requests_total": counts["requests_total"],
        }

    # the rows where they are now (metrics and tests read them)
    @property
    def _waiting(self) -> deque[Row]:
        return self.scheduler.waiting

    @property
    def _prefilling(self) -> list[Row]:
        return self.scheduler.group.rows

    @property
    def _running(self) -> list[Row]:
        return self.decoder.batch.rows

    @property
    def _decode_cache(self) -> list[BatchCache]:
        return self.decoder.batch.caches

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self.busy:
                    mx.clear_cache()  # idle: give MLX's cached buffers back
                with self._lock:
                    while not (self._stopping or self._incoming or self._cancelled or self.busy):
                        self._lock.wait()
                    if self._stopping:
                        break
                try:
                    self.step()
                except Exception as error:  # a bug in a round: fail what was in it, keep serving
                    log.exception("engine step failed")
                    self._round_failed(error)
        finally:
            self._shut_down()
            release_thread_streams()

    @property
    def busy(self) -> bool:
        """Whether any admitted request is unfinished."""
        return bool(self._waiting or self._prefilling or self._running or self.decoder.in_flight)

    def step(self) -> bool:
        """One round: new requests and cancellations, one prefill chunk, one decoding step.
        Returns whether work remains (for driving the engine without its thread)."""
        self._take_in()
        room = self.max_batch - len(self._prefilling) - len(self._running)
        self.scheduler.admit(self.prefix_cache, room, streams_running=bool(self._running))
        self._join_prefilled()
        self.scheduler.prefill_chunk()
        self._join_prefilled()
        self.decoder.step()
        with self._lock:
            return self.busy or bool(self._incoming)

    def fail_admitted(self, error: BaseException | str) -> None:
        """Every row in the prefill group and the decoding batch ends with ``error``."""
        self.outputs.fail(self._prefilling + self._running, error)
        self.scheduler.group.clear()
        self.decoder.reset()

    def _round_failed(self, error: Exception) -> None:
        """A round raised ``error``: its rows end with it and the engine goes on (an engine
        over a model split over ranks cannot: distributed/follow.py)."""
        self.fail_admitted(error)

    def _shut_down(self) -> None:
        self._take_in()
        self.outputs.fail(list(self._waiting), "server shutting down")
        self._waiting.clear()
        self.fail_admitted("server shutting down")

    def _take_in(self) -> None:
        """New rows start waiting (or get their one error event); cancelled ones end."""
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            cancelled, self._cancelled = self._cancelled, set()
        for row in incoming:
            try:
                row.prepare(self.model, self.tokenizer, self._single_caches, self._entropy.getrandbits(63))
                self._waiting.append(row)
            except Exception as error:
                self.outputs.fail([row], error)
        for row in [r for r in self._waiting if r.id in cancelled]:
            self._waiting.remove(row)
            self.outputs.cancel(row)
        for row in self._prefilling + self._running:
            if row.id in cancelled and row.finish_reason is None:
                self.outputs.cancel(row)
        self.scheduler.group.remove_finished(self._remember)
        self.decoder.remove_finished()

    def _join_prefilled(self) -> None:
        prefilled = self.scheduler.take_prefilled()
        if prefilled is not None:
            self.decoder.join(*prefilled)

    def _new_layers(self) -> list:
        """Fresh single-sequence caches, one per layer (chunked layers bounded to a chunk)."""
        return chunk_bounded(self.model, self.model.make_cache(max_kv_size=self.max_kv_size))

    def _remember(self, row: Row, caches: list[BatchCache], index: int) -> None:
        """Put the row's cache, with the tokens it holds, in the shared prefix cache; not
        when a layer no longer holds all of them (a window dropped some)."""
        fed = row.fed
        if self.prefix_cache.max_bytes == 0 or fed == 0 or not all(c.holds_all(index, fed) for c in caches):
            return
        layers = self._new_layers()
        for batched, single in zip(caches, layers):
            batched.export_row(index, single)
        mx.eval([layer.state for layer in layers])
        entry = TokenCache(self.model, self.max_kv_size, layers, row.cache_keys[:fed])  # images: their keys
        entry.snapshots = {n: states for n, states in row.snapshots.items() if n < fed}  # recurrent layers
        self.prefix_cache.insert(entry)


def batch_generate(model, tokenizer, prompts: list[str | list[int]], max_tokens: int | list[int] = 256,
                   sampling: SamplingParams | list[SamplingParams] = SamplingParams(), *,
                   stop_strings=(), max_batch: int = 16, **engine_kwargs) -> list[str]:
    """Generate for every prompt with the batching engine, driven in this thread; the
    texts in the order of ``prompts``. ``engine_kwargs`` as for ``Engine``."""
    n = len(prompts)
    max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    sampling = sampling if isinstance(sampling, list) else [sampling] * n
    if len(max_tokens) != n or len(sampling) != n:
        raise UserError(f"{n} prompts need {n} max_tokens and sampling settings, got {len(max_tokens)} and {len(sampling)}")
    engine = Engine(model, tokenizer, max_batch=max_batch, **engine_kwargs)
    pieces: list[list[str]] = [[] for _ in prompts]
    errors: dict[int, str] = {}

    def collect(i: int, event: Event) -> None:
        pieces[i].append(event.text)
        if event.error:
            errors[i] = event.error

    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt).tolist()
        engine.submit(Request(ids, max_tokens[i], sampling[i], tuple(stop_strings)),
                      lambda event, i=i: collect(i, event))
    while engine.step():
        pass
    if errors:
        first = min(errors)
        raise UserError(f"prompt {first}: {errors[first]}")
    return ["".join(p) for p in pieces]
