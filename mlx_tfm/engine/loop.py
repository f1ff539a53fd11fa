"""The generation engine behind ``mlx-tfm server`` and ``mlx_tfm.batch_generate``:
continuous batching with a prompt cache shared across requests.

Every round of the engine (``Engine.step``):

1. takes in new requests and cancellations (a cancelled row is gone before the next
   forward pass);
2. admits waiting requests while the batch has room (and, while streams are running,
   while the prompt tokens left to read fit one prefill step): each reuses the longest
   prefix the shared prompt cache holds (``PrefixCache``) and joins the *prefill
   group*;
3. runs one chunk of prompt through the prefill group (all its rows together, each
   feeding up to the same number of its own tokens, a row with fewer left padded so that
   prompts of unequal length finish in one pass; ``prefill_step_size`` tokens in all: one
   forward pass's memory is bounded, and running streams keep flowing while long prompts
   are read); a row whose prompt is in (all but its last token) moves to the decoding batch;
4. runs one decoding step: every row of the batch feeds one token, at its own position,
   through one forward pass (``BatchKVCache``: per-row offsets and masks), and gets its
   next token from its own sampler, processors and random stream (``sample_rows``).
   Rows that finish (EOS, a stop string, their token limit, an error) leave, their
   keys and values go to the shared prompt cache, and the batch is compacted.

A row feeds the last token of its prompt in its first decoding step, so the batch always
feeds exactly one token per row. Text goes through the same ``TextPieces`` as
``stream_generate`` (detokenizer, stop strings held back and removed).

The interface (``SamplingParams``, ``Request``, ``Event``, ``Engine``, ``batch_generate``) is
the one documented for the HTTP layer in the project notes (ENGINE_API.md).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Callable

import mlx.core as mx

from ..cpu.switch import prompt_layer_by_layer
from ..errors import UserError
from ..generation.sampling import (
    log_normalizer,
    make_logits_processors,
    make_presence_frequency_penalty,
    make_sampler,
)
from ..generation.step import check_vocabulary, context_room, encode_prompt
from ..generation.stream import TextPieces
from ..generation.token_cache import TokenCache
from .batch_cache import BatchKVCache, empty_batch, layer_windows, single_row_caches
from .prefix_cache import PrefixCache
from .requests import MAX_TOP_LOGPROBS, Event, Request, SamplingParams
from .sampling import (
    BatchSettings,
    RowSettings,
    add_logit_bias,
    sample_rows,
    top_logprobs,
)

log = logging.getLogger("mlx_tfm.engine")
# generation_tps in metrics() counts the tokens of the last this many seconds
TPS_WINDOW_S = 10.0
MAX_PADDING_SHARE = 0.25  # of a prefill chunk's positions (see chunk_length)
PAD_TOKEN = 0  # what a padded position feeds; its keys and values are never visible


class Row:
    """One admitted request: its tokens, how many of them its cache holds, its sampler
    settings, random key, processors and text pieces."""

    def __init__(self, request_id: int, request: Request, on_event: Callable[[Event], None]):
        self.id = request_id
        self.request = request
        self.on_event = on_event
        self.tokens = list(request.prompt)  # the prompt, then every generated token
        self.fed = 0  # tokens[:fed] are in the row's cache; tokens[fed] is fed next
        self.cached_tokens = 0
        self.generated = 0
        self.max_tokens = request.max_tokens
        self.finish_reason: str | None = None
        self.settings = RowSettings()
        self.key: mx.array | None = None
        self.processors: list = []
        self.pieces: TextPieces | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt)

    @property
    def pending(self) -> int:
        """Prompt tokens still to prefill (all but the last, which the first decoding step feeds)."""
        return max(0, self.prompt_length - 1 - self.fed)

    @property
    def prefilled(self) -> bool:
        return self.pending == 0

    def event(self, token, text, finish_reason, logprob=None, top=None, error=None, internal=False) -> Event:
        return Event(token=token, text=text, logprob=logprob, top_logprobs=top, finish_reason=finish_reason,
                     prompt_tokens=self.prompt_length, cached_tokens=self.cached_tokens,
                     generation_tokens=self.generated, error=error, internal=internal)


@dataclass
class DecodeStep:
    """A decoding step queued for ``rows``: its outputs, computed or still being computed."""

    rows: list[Row]
    tokens: mx.array  # (B,)
    logprobs: mx.array  # (B,) of the chosen tokens
    log_norms: mx.array  # (B,) log-sum-exp of the logits; NaN when the logits were
    top: tuple  # () or (top logprobs (B, k), their ids (B, k))


def one_line(error: BaseException) -> str:
    if isinstance(error, UserError):
        return str(error).splitlines()[0] if str(error) else "invalid request"
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


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
        self.prefill_step_size = prefill_step_size
        self.max_kv_size = max_kv_size
        self.windows = layer_windows(model, max_kv_size)
        self.prefix_cache = PrefixCache(prompt_cache_bytes)
        self._empty_caches = model.make_cache(max_kv_size=max_kv_size)  # context_room reads their kind
        args = model.args
        # Learned position embeddings have one row per position: a padded chunk's positions,
        # padding included, must stay inside the table.
        self._learned_positions = (args.max_position_embeddings - args.position_offset
                                   if args.position_embedding == "learned" else None)
        self._ids = count(1)
        self._entropy = random.SystemRandom()
        self._lock = threading.Condition()
        self._incoming: deque[Row] = deque()
        self._cancelled: set[int] = set()
        self._waiting: deque[Row] = deque()
        self._prefilling: list[Row] = []
        self._prefill_cache = empty_batch(self.windows)
        self._running: list[Row] = []
        self._decode_cache = empty_batch(self.windows)
        self._settings: BatchSettings | None = None  # of the running rows; None: rebuild
        self._keys: mx.array | None = None  # (B, 2) the running rows' random keys
        self._in_flight: DecodeStep | None = None  # queued last round, collected next round
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats_lock = threading.Lock()
        self._stats = {"prompt_tokens_total": 0, "generation_tokens_total": 0}
        self._finished: dict[str, int] = {}
        self._recent: deque[tuple[float, int]] = deque()

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
        with self._stats_lock:
            recent = list(self._recent)
            stats = dict(self._stats)
            finished = dict(self._finished)
        span = max(time.perf_counter() - recent[0][0], 1.0) if recent else 1.0
        tps = sum(n for _, n in recent) / span
        return {
            "running": len(self._running) + len(self._prefilling),
            "waiting": len(self._waiting) + len(self._incoming),
            **stats,
            "generation_tps": tps,
            "prompt_cache_hits": self.prefix_cache.hits,
            "prompt_cache_misses": self.prefix_cache.misses,
            "prompt_cache_bytes": self.prefix_cache.nbytes,
            "requests_total": finished,
        }

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
                    self._fail(self._prefilling + self._running, error)
                    self._reset_batches()
        finally:
            self._shut_down()
            # MLX keeps per-thread streams and compile caches; a thread that exits without
            # freeing them crashes the process at exit (mlx PR #4373)
            mx.clear_streams()

    @property
    def busy(self) -> bool:
        """Whether any admitted request is unfinished."""
        return bool(self._waiting or self._prefilling or self._running or self._in_flight)

    def step(self) -> bool:
        """One round: new requests and cancellations, one prefill chunk, one decoding step.
        Returns whether work remains (for driving the engine without its thread)."""
        self._take_in()
        self._admit()
        self._prefill_chunk()
        self._decode()
        with self._lock:
            return self.busy or bool(self._incoming)

    def _shut_down(self) -> None:
        self._take_in()
        self._fail(list(self._waiting) + self._prefilling + self._running, "server shutting down")
        self._waiting.clear()
        self._reset_batches()

    # -- intake ----------------------------------------------------------------------------------
    def _take_in(self) -> None:
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            cancelled, self._cancelled = self._cancelled, set()
        for row in incoming:
            try:
                self._prepare(row)
                self._waiting.append(row)
            except Exception as error:
                self._fail([row], error)
        for row in [r for r in self._waiting if r.id in cancelled]:
            self._waiting.remove(row)
            self._finish(row, row.event(None, "", "cancelled"))
        for row in self._prefilling + self._running:
            if row.id in cancelled and row.finish_reason is None:
                self._finish(row, row.event(None, "", "cancelled"))
        self._drop_finished()

    def _prepare(self, row: Row) -> None:
        """Check the request and build the row's sampler settings, key, processors and text
        pieces (a UserError is the request's one error event)."""
        request, sampling = row.request, row.request.sampling
        prompt = request.prompt
        if not prompt:
            raise UserError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.model.args.vocab_size:
            raise UserError(f"the prompt holds token ids outside the model's vocabulary of {self.model.args.vocab_size}")
        if request.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        make_sampler(sampling.temp, sampling.top_p, sampling.top_k, sampling.min_p)  # checks the settings
        room = context_room(self.model, self._empty_caches, len(prompt))
        row.max_tokens = request.max_tokens if room is None else min(request.max_tokens, room)
        bias = tuple(sorted((sampling.logit_bias or {}).items()))
        if bias and not all(0 <= token < self.model.args.vocab_size for token, _ in bias):
            raise UserError(f"logit_bias names token ids outside the model's vocabulary of {self.model.args.vocab_size}")
        row.settings = RowSettings(sampling.temp, sampling.top_p, sampling.top_k, sampling.min_p, bias)
        seed = sampling.seed if sampling.seed is not None else self._entropy.getrandbits(63)
        row.key = mx.random.key(seed)
        row.processors = make_logits_processors(sampling.repetition_penalty, sampling.repetition_context_size)
        if sampling.presence_penalty or sampling.frequency_penalty:
            row.processors.append(make_presence_frequency_penalty(
                sampling.presence_penalty, sampling.frequency_penalty, len(prompt)))
        row.processors += list(request.logits_processors)
        row.pieces = TextPieces(self.tokenizer, mx.array(prompt), list(request.stop_strings))

    def _admit(self) -> None:
        """Waiting requests join the prefill group while the batch has room. While streams
        are running, only as long as the group's prompt tokens still to read fit one prefill
        step (a first row always joins), so that a few prompts are read whole between
        decoding steps; with no stream to keep flowing, every request that fits the batch
        joins and their prompts are read together (the last first token comes soonest)."""
        joining = []  # per admitted row, its cache per layer: they join the group together
        while self._waiting and len(self._prefilling) + len(self._running) < self.max_batch:
            row = self._waiting[0]
            pending = row.prompt_length - 1 - self.prefix_cache.find(row.tokens, limit=row.prompt_length - 1)[1]
            budget = sum(r.pending for r in self._prefilling) + pending
            if self._prefilling and self._running and budget > self.prefill_step_size:
                break
            self._waiting.popleft()
            entry, cached = self.prefix_cache.lookup(row.tokens, limit=row.prompt_length - 1)
            states = self.prefix_cache.prefix_states(entry, cached) if entry else [(None, None)] * len(self.windows)
            row.cached_tokens = row.fed = cached
            joining.append([BatchKVCache.for_row(keys, values, cached, window)
                            for (keys, values), window in zip(states, self.windows)])
            self._prefilling.append(row)
            with self._stats_lock:
                self._stats["prompt_tokens_total"] += row.prompt_length
        for i, layer in enumerate(self._prefill_cache):
            layer.extend(*(row_caches[i] for row_caches in joining))

    # -- prefill ---------------------------------------------------------------------------------
    def _prefill_chunk(self) -> None:
        """Feed every prefilling row the same number of its next prompt tokens, at most
        ``prefill_step_size`` in all; rows whose prompt is in join the decoding batch."""
        self._join_prefilled()
        rows = self._prefilling
        if not rows:
            return
        per_row = max(1, self.prefill_step_size // len(rows))
        if self._learned_positions is not None:
            per_row = max(1, min(per_row, *(self._learned_positions - r.fed for r in rows)))
        length = chunk_length([r.pending for r in rows], per_row)
        feeds = [min(r.pending, length) for r in rows]
        chunk = mx.array([r.tokens[r.fed : r.fed + n] + [PAD_TOKEN] * (length - n)
                          for r, n in zip(rows, feeds)])  # (G, length), each row padded at its end
        try:
            with prompt_layer_by_layer():
                self.model(chunk, cache=self._prefill_cache)
            for layer in self._prefill_cache:
                layer.drop_padding([length - n for n in feeds])
            mx.eval([(layer.keys, layer.values) for layer in self._prefill_cache])
        except Exception as error:
            log.exception("prefill failed")
            self._fail(rows, error)
            self._prefilling, self._prefill_cache = [], empty_batch(self.windows)
            return
        for row, n in zip(rows, feeds):
            row.fed += n
        self._join_prefilled()

    def _join_prefilled(self) -> None:
        ready = [i for i, r in enumerate(self._prefilling) if r.prefilled]
        if not ready:
            return
        rest = [i for i, r in enumerate(self._prefilling) if not r.prefilled]
        self._store_keys()
        for prefill_layer, decode_layer in zip(self._prefill_cache, self._decode_cache):
            decode_layer.extend(prefill_layer.select(ready) if rest else prefill_layer)
        self._running += [self._prefilling[i] for i in ready]
        self._prefill_cache = [layer.select(rest) for layer in self._prefill_cache]
        self._prefilling = [self._prefilling[i] for i in rest]
        self._settings = None

    # -- decoding --------------------------------------------------------------------------------
    def _decode(self) -> None:
        """Queue the next decoding step, then hand out the tokens of the one queued in the
        previous round: MLX computes a step while this thread detokenizes and sends the
        last one (as ``generate_step`` does). The next step feeds the previous one's tokens
        without waiting for their values, so a row that finishes there computes one step
        more, never shown. Rows with logits processors need every token's value first:
        then each step is collected at once."""
        previous, self._in_flight = self._in_flight, None
        in_order = any(r.processors for r in self._running)
        if previous is not None and (in_order or not self._can_follow(previous)):
            self._collect(previous)
            previous = None
        step = self._queue(previous) if self._running else None
        if previous is not None:
            self._collect(previous)
        if step is not None and in_order:
            self._collect(step)
        elif step is not None:
            self._in_flight = step

    def _can_follow(self, previous: "DecodeStep") -> bool:
        """Whether the running rows are the previous step's (finished ones gone), newcomers
        after them: then its tokens feed the next step unread."""
        carried = {r.id for r in previous.rows}
        n = sum(r.id in carried for r in self._running)
        return all(r.id in carried for r in self._running[:n])

    def _queue(self, previous: "DecodeStep | None") -> "DecodeStep | None":
        """Build one forward pass and sampling for every running row and start computing it."""
        rows = self._running
        try:
            if self._settings is None:
                self._settings = BatchSettings([r.settings for r in rows])
                self._keys = mx.stack([r.key for r in rows])
            logits = self.model(self._inputs(rows, previous), cache=self._decode_cache)[:, -1, :]  # (B, V)
            for row in rows:
                row.fed += 1
            logits = self._process(rows, add_logit_bias(logits, self._settings))
            log_norm = log_normalizer(logits)[:, 0]  # (B,)
            logprobs = logits - log_norm[:, None]
            tokens, keys = sample_rows(logprobs, self._settings, self._keys)
            chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
            k = max(r.request.top_logprobs for r in rows)
            top = top_logprobs(logprobs, k) if k else ()
            mx.async_eval(tokens, keys, chosen, log_norm, *top)
        except Exception as error:
            self._fail_decoding(error)
            return None
        self._keys = keys
        return DecodeStep(list(rows), tokens, chosen, log_norm, top)

    @staticmethod
    def _inputs(rows: list[Row], previous: "DecodeStep | None") -> mx.array:
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

    def _collect(self, step: "DecodeStep") -> None:
        """Wait for a queued step and send its events; finished rows leave the batch."""
        try:
            tokens, chosen, log_norms = step.tokens.tolist(), step.logprobs.tolist(), step.log_norms.tolist()
            alternatives = [None] * len(step.rows)
            if step.top:
                values, ids = step.top[0].tolist(), step.top[1].tolist()
                alternatives = [list(zip(ids[i][: r.request.top_logprobs], values[i][: r.request.top_logprobs]))
                                for i, r in enumerate(step.rows)]
        except Exception as error:
            self._fail_decoding(error, step.rows)
            return
        generated = 0
        for i, row in enumerate(step.rows):
            if row.finish_reason is not None:  # cancelled, failed, or finished a step earlier
                continue
            if math.isnan(log_norms[i]):
                self._fail([row], "the model produced NaN logits")
                continue
            self._advance(row, tokens[i], chosen[i], alternatives[i])
            generated += 1
        with self._stats_lock:
            self._stats["generation_tokens_total"] += generated
            now = time.perf_counter()
            self._recent.append((now, generated))
            while self._recent and now - self._recent[0][0] > TPS_WINDOW_S:
                self._recent.popleft()
        self._drop_finished()

    def _fail_decoding(self, error: Exception, rows: list[Row] = ()) -> None:
        """A decoding step raised: every row of the decoding batch fails; prefilling and
        waiting requests go on."""
        log.error("decoding step failed", exc_info=error)
        self._fail(list(rows) + self._running, error)
        self._running, self._decode_cache = [], empty_batch(self.windows)
        self._settings = self._keys = self._in_flight = None

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
                    self._fail([row], error)
                    row_logits = logits[i : i + 1]
            processed.append(row_logits.astype(logits.dtype))
        return mx.concatenate(processed)

    def _advance(self, row: Row, token: int, logprob: float, alternatives) -> None:
        row.generated += 1
        row.tokens.append(token)
        text, finish_reason = row.pieces.add(token)
        if finish_reason is None and row.generated >= row.max_tokens:
            tail, finish_reason = row.pieces.finish()
            text += tail
        event = row.event(token, text, finish_reason, logprob if row.request.logprobs else None,
                          alternatives if row.request.top_logprobs else None)
        if finish_reason is not None:
            self._finish(row, event)
        else:
            self._emit(row, event)

    # -- leaving -----------------------------------------------------------------------------------
    def _emit(self, row: Row, event: Event) -> None:
        try:
            row.on_event(event)
        except Exception:  # the receiver is gone: free the row, no more events
            log.exception("on_event failed for request %d; dropping it", row.id)
            if row.finish_reason is None:
                row.finish_reason = "cancelled"

    def _finish(self, row: Row, event: Event) -> None:
        row.finish_reason = event.finish_reason
        with self._stats_lock:
            self._finished[event.finish_reason] = self._finished.get(event.finish_reason, 0) + 1
        self._emit(row, event)

    def _fail(self, rows: list[Row], error: BaseException | str) -> None:
        message = error if isinstance(error, str) else one_line(error)
        internal = not isinstance(error, (str, UserError))  # an unexpected exception, not the engine's own words
        for row in rows:
            if row.finish_reason is None:
                self._finish(row, row.event(None, "", "error", error=message, internal=internal))

    def _drop_finished(self) -> None:
        """Compact both batches: finished rows leave (to the prompt cache unless they failed)."""
        for running in (False, True):
            rows = self._running if running else self._prefilling
            caches = self._decode_cache if running else self._prefill_cache
            done = [i for i, r in enumerate(rows) if r.finish_reason is not None]
            if not done:
                continue
            for i in done:
                if rows[i].finish_reason != "error":
                    self._remember(rows[i], caches, i)
            keep = [i for i, r in enumerate(rows) if r.finish_reason is None]
            if running:
                self._store_keys()
                self._running = [rows[i] for i in keep]
                self._decode_cache = [layer.select(keep) for layer in caches]
                self._settings = None
            else:
                self._prefilling = [rows[i] for i in keep]
                self._prefill_cache = [layer.select(keep) for layer in caches]

    def _remember(self, row: Row, caches: list[BatchKVCache], index: int) -> None:
        """Put the row's keys and values, with the tokens they hold, in the shared prompt
        cache; not when a window has dropped some of its positions."""
        fed = row.fed
        complete = all(layer.row_length(index) == fed and (w is None or fed < w)
                       for layer, w in zip(caches, self.windows))
        if self.prefix_cache.max_bytes == 0 or fed == 0 or not complete:
            return
        states = [layer.row_state(index) for layer in caches]
        layers = single_row_caches(self.model, self.max_kv_size, states, fed)
        mx.eval([layer.state for layer in layers])
        self.prefix_cache.insert(TokenCache(self.model, self.max_kv_size, layers, row.tokens[:fed]))

    def _store_keys(self) -> None:
        """Give each running row its current key back before the batch changes."""
        if self._settings is not None and self._keys is not None:
            for i, row in enumerate(self._running):
                row.key = self._keys[i]

    def _reset_batches(self) -> None:
        self._prefilling, self._prefill_cache = [], empty_batch(self.windows)
        self._running, self._decode_cache = [], empty_batch(self.windows)
        self._settings = self._keys = self._in_flight = None


def chunk_length(pending: list[int], per_row: int) -> int:
    """How many tokens a prefill chunk feeds each row (rows with fewer left are padded):
    the most that keeps padding within ``MAX_PADDING_SHARE`` of the chunk. A forward pass
    reads every weight whatever its length, so finishing the prompts of unequal length
    together beats a pass for each remainder; the shortest remainder never pads."""
    for length in sorted({min(p, per_row) for p in pending}, reverse=True):
        padding = sum(length - min(p, length) for p in pending)
        if padding <= MAX_PADDING_SHARE * length * len(pending):
            return length
    raise AssertionError("unreachable: the shortest remainder needs no padding")


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
