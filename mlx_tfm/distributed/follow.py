"""How the other ranks follow rank 0 when a model is split over them.

Every rank runs the same program over its part of the model: each forward pass is a
collective, so every rank must make the same calls, with the same shapes, in the same
order. Whatever decides those calls and is not in the command line is rank 0's alone
(what a person types, an HTTP request, a file on rank 0's machine, a moment of Ctrl-C),
so rank 0 sends it over the control connection (``World.share``) and the others act on
it exactly where rank 0 does. Sampling needs nothing: all ranks compute the same logits
from the same random state, so they draw the same tokens.

- ``chat_session`` / ``LeaderLines`` / ``FollowedLines``: the chat REPL on every rank,
  the lines rank 0 reads, its answer stops and loaded conversations shared;
- ``MirroredEngine``: the server's batching engine, the requests and cancellations rank 0
  takes in each round shared (with a seed drawn for each request that has none). A round
  that raises on any rank ends the ranks: the others may be waiting in one of its
  collectives, which nothing can call off, so no further round could be run alike. Rank
  0's server first answers every request it holds with an error (a 500), then every rank
  stops with one line naming the rank that failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import mlx.core as mx

from ..chat.conversation import ChatSession, load_conversation
from ..engine.loop import Engine
from ..engine.outputs import one_line
from ..engine.prefix_cache import PrefixCache
from ..engine.rows import Row
from ..errors import UserError
from .control import ANSWER_GRACE_S, stop_process
from .world import World

log = logging.getLogger("mlx_tfm.engine")

SPLIT_STOPPED = "the model split over ranks stopped: an engine round failed (the server's log says where)"
LOCK_WAIT_S = 1.0  # how long answering the requests waits for the engine's lock (its thread may hang in a collective)
CONSTRAINED_REFUSAL = ("constrained output (response_format with a schema, or tools) is not supported on a model "
                       "split over ranks (--pipeline, --tensor-parallel)")


# -- chat ------------------------------------------------------------------------------------


class LeaderLines:
    """Rank 0's line reader: every line it reads, or the end of its input, also goes to
    the other ranks."""

    def __init__(self, reader, world: World):
        self.reader, self.world = reader, world

    def read(self, prompt: str) -> str:
        try:
            line = self.reader.read(prompt)
        except (EOFError, KeyboardInterrupt) as end:
            self.world.share(("end", type(end).__name__))
            raise
        self.world.share(("line", line))
        return line

    def busy(self):
        return self.reader.busy()


class FollowedLines:
    """A follower's line reader: rank 0's lines."""

    ENDS = {"EOFError": EOFError, "KeyboardInterrupt": KeyboardInterrupt}

    def __init__(self, world: World):
        self.world = world

    def read(self, prompt: str) -> str:
        kind, value = self.world.share()
        if kind == "end":
            raise self.ENDS[value]
        return value

    def busy(self):
        return contextlib.nullcontext()


class LeaderChatSession(ChatSession):
    """Rank 0's session: when it stops an answer, and a conversation it loads from its
    disk, go to the other ranks."""

    def __init__(self, *args, world: World, **kwargs):
        super().__init__(*args, **kwargs)
        self.world = world

    def answer(self, message: str, should_stop=lambda: False):
        return super().answer(message, lambda: self.world.share(bool(should_stop())))

    def load(self, path) -> int:
        try:
            conversation = load_conversation(path)
        except UserError as e:
            self.world.share(("refused", str(e)))
            raise
        self.world.share(("conversation", conversation))
        self.conversation = conversation
        return self.rebuild_cache()


class FollowerChatSession(ChatSession):
    """A follower's session: it stops and loads as rank 0 does, and writes no file."""

    def __init__(self, *args, world: World, **kwargs):
        super().__init__(*args, **kwargs)
        self.world = world

    def answer(self, message: str, should_stop=lambda: False):
        return super().answer(message, self.world.share)

    def save(self, path) -> int:
        """Rank 0 writes the file; a follower counts what it would have written."""
        return len(self.conversation.messages())

    def load(self, path) -> int:
        kind, value = self.world.share()
        if kind == "refused":
            raise UserError(value)
        self.conversation = value
        return self.rebuild_cache()


def chat_session(world: World, **session_args) -> ChatSession:
    """The chat session for this rank (``ChatSession``'s arguments)."""
    if world.size == 1:
        return ChatSession(**session_args)
    kind = LeaderChatSession if world.leader else FollowerChatSession
    return kind(**session_args, world=world)


def chat_reader(world: World, make_reader):
    """This rank's line reader: ``make_reader()``'s, shared by rank 0; rank 0's lines on
    the others."""
    if world.size == 1:
        return make_reader()
    return LeaderLines(make_reader(), world) if world.leader else FollowedLines(world)


# -- the server's engine ----------------------------------------------------------------------


class Stopped(Exception):
    """Rank 0's engine stopped; so does this rank's."""


class SizedEntry:
    """A prefix cache entry (``TokenCache``) counted by the bytes the whole cluster holds
    for it; everything else (its tokens, layers, snapshots, ``resumable``...) is the entry's."""

    def __init__(self, cache, nbytes: int):
        self.cache, self.nbytes = cache, nbytes

    def __getattr__(self, name: str):
        return getattr(self.cache, name)


class ClusterPrefixCache(PrefixCache):
    """The shared prefix cache of a split model: an entry counts what every rank holds
    for it (a pipeline's ranks hold different numbers of layers), so every rank keeps
    and drops the same entries and reuses the same prefixes."""

    def __init__(self, max_bytes: int, world: World):
        super().__init__(max_bytes)
        self.world = world

    def insert(self, entry) -> None:
        total = mx.distributed.all_sum(mx.array(entry.nbytes, dtype=mx.int64), group=self.world.group).item()
        super().insert(SizedEntry(entry, total))


def ignore_event(event) -> None:
    """A follower's rows report to nobody."""


class MirroredEngine(Engine):
    """The batching engine over a split model, on every rank. Rank 0's serves; at the
    start of each round it sends the others what it takes in (the new requests with their
    ids, cancellations, whether it is stopping), and their engines take in the same and
    run the same round. Requests with their own logits processors (constrained output)
    are refused: the processors live in rank 0's HTTP layer."""

    def __init__(self, model, tokenizer, world: World, **engine_args):
        super().__init__(model, tokenizer, **engine_args)
        self.world = world
        self.prefix_cache = ClusterPrefixCache(self.prefix_cache.max_bytes, world)
        if world.leader and world.link is not None:  # a follower's failure ends rank 0: answer first
            world.link.before_stop.append(self.fail_everything)

    def fail_everything(self, reason: str) -> None:
        """The ranks stop (``reason``): every request this engine holds ends with an error
        event, and new ones get one at once. Called from a watch thread while the engine's
        may be waiting in a collective for good, so the lock is waited for only a while."""
        log.error("the model split over ranks stops: %s", reason)
        held = self._lock.acquire(timeout=LOCK_WAIT_S)
        try:
            self._stopping = True  # submit answers "server shutting down" from now on
            rows = [*self._incoming, *self._waiting, *self._prefilling, *self._running]
            self.outputs.fail(rows, SPLIT_STOPPED)
        finally:
            if held:
                self._lock.release()

    def _round_failed(self, error: Exception) -> None:
        """Rank 0's round raised: answer every request, tell the other ranks (they stop
        with the line), and end this process too."""
        reason = f"an engine round failed on rank 0 ({one_line(error)})"
        self.fail_everything(reason)
        self.world.link.end(reason)
        time.sleep(ANSWER_GRACE_S)
        stop_process(f"{reason}; every rank stops")

    def submit(self, request, on_event) -> int:
        if request.logits_processors:
            on_event(Row(0, request, on_event).event(None, "", "error", error=CONSTRAINED_REFUSAL))
            return 0
        if request.sampling.seed is None:  # drawn here, so every rank's row draws the same tokens
            sampling = dataclasses.replace(request.sampling, seed=self._entropy.getrandbits(63))
            request = dataclasses.replace(request, sampling=sampling)
        request_id = []
        request_id.append(super().submit(request, self._reporting(on_event, request_id)))
        return request_id[0]

    def _reporting(self, on_event, request_id: list):
        """``on_event`` that never raises: a receiver that fails has its request cancelled
        at the next round, on every rank (the plain engine frees the row at once)."""

        def deliver(event) -> None:
            try:
                on_event(event)
            except Exception:
                log.exception("on_event failed; cancelling the request")
                if request_id:
                    self.cancel(request_id[0])

        return deliver

    def _take_in(self) -> None:
        if self.world.leader:
            with self._lock:  # re-entrant: the base takes the same intake under it
                self.world.share(([(row.id, row.request) for row in self._incoming], sorted(self._cancelled),
                                  self._stopping))
                super()._take_in()
            return
        rows, cancelled, stopping = self.world.share()
        if stopping:
            raise Stopped
        with self._lock:
            self._incoming.extend(Row(request_id, request, ignore_event) for request_id, request in rows)
            self._cancelled.update(cancelled)
        super()._take_in()

    def follow(self) -> None:
        """A follower's engine: the rounds rank 0 runs, until it stops. A round that raises
        here ends this rank with one line (and rank 0, told so, answers its requests)."""
        while True:
            try:
                self.step()
            except Stopped:
                return
            except UserError:
                raise  # rank 0 is gone, or the engine's own words
            except Exception as error:
                log.exception("engine step failed")
                raise UserError(f"an engine round failed on rank {self.world.rank} ({one_line(error)}): "
                                "the ranks can no longer run the same rounds") from None


def engine_for(model, tokenizer, world: World, **engine_args) -> Engine:
    """The batching engine for this rank: the plain one for a whole model."""
    if world.size == 1:
        return Engine(model, tokenizer, **engine_args)
    return MirroredEngine(model, tokenizer, world, **engine_args)
