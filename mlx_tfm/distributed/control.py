"""The control connections beside MLX's ring: every rank keeps one TCP connection to rank 0.

They carry what MLX's collectives cannot carry safely:

- **the roll call**: rank 0 listens, the others connect and say who they are; a rank that
  has not connected within the timeout is named, and every rank exits with that line,
  before anyone enters ``mx.distributed.init`` (which would wait forever for it);
- **the watch**: a beat every second each way; a connection that closes (the process
  died: killed, crashed, out of memory) or stays silent past the timeout (its machine or
  network went down) ends every rank with one line naming the rank; a rank that fails
  with an error says so first, and the others repeat its message;
- **rank 0's decisions** (``send`` / ``receive``): a prompt read from stdin, a seed, the
  requests the server's engine takes in each round, a chat's lines. Followers block on a
  queue (MLX's ring would spin a core while waiting).

Messages are ``(length, kind)`` headers and a payload. Data are pickled and read back
with an unpickler that builds only plain values and mlx_tfm's own classes: the control
port, like the ring's, belongs on a trusted network.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import queue
import socket
import struct
import sys
import threading
import time
from typing import Callable

from ..errors import UserError
from .launch import Launch

HEADER = struct.Struct(">IB")  # payload length, kind
HELLO, GO, BEAT, DATA, DONE, FAIL, LOST = range(1, 8)
BEAT_S = 1.0
RETRY_S = 0.2
ANSWER_GRACE_S = 2.0  # for rank 0's server to write the errors it answers before the process ends


class Lost(Exception):
    """A connection closed or went silent."""


def send_message(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(len(payload), kind) + payload)


def receive_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except socket.timeout:
            raise Lost("silent") from None
        except OSError:
            raise Lost("closed") from None
        if not chunk:
            raise Lost("closed")
        data += chunk
    return bytes(data)


def receive_message(sock: socket.socket) -> tuple[int, bytes]:
    length, kind = HEADER.unpack(receive_exactly(sock, HEADER.size))
    return kind, receive_exactly(sock, length)


SAFE_BUILTINS = {"set", "frozenset", "complex", "slice", "range", "bytearray"}


class PlainUnpickler(pickle.Unpickler):
    """Plain values (lists, dicts, numbers, text, bytes) and mlx_tfm's own classes only."""

    def find_class(self, module: str, name: str):
        if (module == "builtins" and name in SAFE_BUILTINS) or module == "mlx_tfm" or module.startswith("mlx_tfm."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"rank 0 sent a {module}.{name}, which the control connection does not carry")


def loads(data: bytes):
    return PlainUnpickler(io.BytesIO(data)).load()


# Where this rank's error lines go: stderr, or (a follower, whose output is silenced) the
# stderr it started with, each line marked with its rank (world.quiet_follower sets it).
errors_to = None


def say(line: str) -> None:
    print(f"error: {line}", file=errors_to or sys.stderr, flush=True)


def stop_process(line: str) -> None:
    """Print the one line and end this process now, whatever its threads are doing (one
    may be blocked in a collective that will never complete)."""
    say(line)
    os._exit(1)


class ControlLink:
    """This rank's side of the control connections (see the module docstring)."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.peers: dict[int, socket.socket] = {}  # rank 0: every other rank; others: {0: rank 0}
        self.finished: set[int] = set()  # ranks that said they are done
        self.inbox: queue.Queue = queue.Queue()  # followers: rank 0's data, in order
        self.locks: dict[int, threading.Lock] = {}
        self.ended = False
        # What this rank answers before a peer's failure ends it (rank 0's server: its requests)
        self.before_stop: list[Callable[[str], None]] = []

    # -- the roll call ------------------------------------------------------------------
    def connect(self) -> None:
        """Rank 0: wait for every other rank; the others: reach rank 0. Either within the
        timeout, or a UserError naming who is missing."""
        if self.launch.rank == 0:
            self._gather()
        else:
            self._report_in()
        self.locks = {rank: threading.Lock() for rank in self.peers}

    def _gather(self) -> None:
        host, port = self.launch.control
        deadline = time.monotonic() + self.launch.timeout_s
        try:
            listener = socket.create_server((host, port))
        except OSError as e:
            raise UserError(f"rank 0 cannot listen on {host}:{port} for the other ranks ({e.strerror}); is that "
                            f"address this machine's, and the port free? (set MLX_TFM_CONTROL_ADDRESS)") from None
        with listener:
            while len(self.peers) < self.launch.size - 1:
                listener.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    sock, _ = listener.accept()
                except socket.timeout:
                    break
                self._admit(sock, deadline)
        missing = [r for r in range(1, self.launch.size) if r not in self.peers]
        if missing:
            for sock in self.peers.values():
                send_message(sock, LOST, json.dumps({"rank": missing[0], "reason": "never connected"}).encode())
            ranks = ", ".join(map(str, missing))
            raise UserError(f"rank {ranks} did not connect to rank 0 ({host}:{port}) within "
                            f"{self.launch.timeout_s:g} s: is it started, and can it reach that address?")
        for sock in self.peers.values():
            send_message(sock, GO)

    def _admit(self, sock: socket.socket, deadline: float) -> None:
        """A connecting rank's hello (a stranger or a rank of another launch is dropped)."""
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            kind, payload = receive_message(sock)
            hello = json.loads(payload) if kind == HELLO else {}
        except (Lost, ValueError):
            hello = {}
        rank = hello.get("rank")
        if hello.get("size") != self.launch.size or not isinstance(rank, int) or not 0 < rank < self.launch.size \
                or rank in self.peers:
            sock.close()
            return
        self.peers[rank] = sock

    def _report_in(self) -> None:
        host, port = self.launch.control
        deadline = time.monotonic() + self.launch.timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.01))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise UserError(f"rank 0 did not answer at {host}:{port} within {self.launch.timeout_s:g} s: "
                                    "is it started, and is that address reachable from here?") from None
                time.sleep(RETRY_S)
        send_message(sock, HELLO, json.dumps({"rank": self.launch.rank, "size": self.launch.size}).encode())
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            kind, payload = receive_message(sock)
        except Lost:
            raise UserError(f"rank 0 ({host}:{port}) did not start the run within {self.launch.timeout_s:g} s") from None
        if kind == LOST:
            lost = json.loads(payload)
            raise UserError(f"rank {lost['rank']} did not connect to rank 0 within {self.launch.timeout_s:g} s")
        self.peers[0] = sock

    # -- the watch ------------------------------------------------------------------------
    def watch(self) -> None:
        """Beat, and read every peer's messages, on daemon threads from now on."""
        for rank, sock in self.peers.items():
            sock.settimeout(self.launch.timeout_s)
            threading.Thread(target=self._read, args=(rank, sock), name=f"mlx-tfm-watch-{rank}", daemon=True).start()
        threading.Thread(target=self._beat, name="mlx-tfm-beat", daemon=True).start()

    def _beat(self) -> None:
        while not self.ended:
            for rank in list(self.peers):
                self._send(rank, BEAT)
            time.sleep(BEAT_S)

    def _send(self, rank: int, kind: int, payload: bytes = b"") -> None:
        try:
            with self.locks[rank]:
                send_message(self.peers[rank], kind, payload)
        except OSError:
            pass  # its reader will report it

    def _read(self, rank: int, sock: socket.socket) -> None:
        while True:
            try:
                kind, payload = receive_message(sock)
            except Lost as lost:
                self._peer_lost(rank, str(lost))
                return
            if kind == DATA:
                self.inbox.put(payload)
            elif kind == DONE:
                self.finished.add(rank)
                self.inbox.put(None)  # anyone still waiting for rank 0 waits in vain
            elif kind == FAIL:
                self._peer_failed(rank, payload.decode(errors="replace"))
            elif kind == LOST:
                lost = json.loads(payload)
                self.stop_for_peer(f"rank {lost['rank']} {lost['reason']}; rank {self.launch.rank} stops too")

    def _peer_lost(self, rank: int, how: str) -> None:
        if rank in self.finished or self.ended:
            return
        if how == "silent":
            reason = f"was not heard from for {self.launch.timeout_s:g} s (its machine or network may be down)"
        else:
            reason = "stopped without finishing (killed, crashed, or out of memory: see its own output)"
        self._peer_failed(rank, reason, said=False)

    def _peer_failed(self, rank: int, reason: str, said: bool = True) -> None:
        """A peer is gone: rank 0 tells the others; every rank stops with one line."""
        text = f"failed: {reason}" if said else reason
        if self.launch.rank == 0:
            for other in self.peers:
                if other != rank:
                    self._send(other, LOST, json.dumps({"rank": rank, "reason": text}).encode())
        self.stop_for_peer(f"rank {rank} {text}; rank {self.launch.rank} stops too")

    def stop_for_peer(self, line: str) -> None:
        """End this process with ``line`` once ``before_stop`` has answered what it holds
        (and had ``ANSWER_GRACE_S`` to deliver it)."""
        if self.before_stop:
            for answer in self.before_stop:
                try:
                    answer(line)
                except Exception:  # the line must still be said and the process end
                    pass
            time.sleep(ANSWER_GRACE_S)
        stop_process(line)

    # -- rank 0's decisions ---------------------------------------------------------------
    def send(self, value) -> None:
        """Rank 0: hand ``value`` to every other rank (in order with everything it sends)."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in self.peers:
            self._send(rank, DATA, payload)

    def receive(self):
        """The next value rank 0 sent (waits for it)."""
        payload = self.inbox.get()
        if payload is None:
            raise UserError("rank 0 finished while this rank still expected its instructions")
        return loads(payload)

    # -- the end ----------------------------------------------------------------------------
    def end(self, failure: str | None) -> None:
        """This rank's command ended: tell the peers it finished, or why it failed."""
        if self.ended:
            return
        self.ended = True
        for rank in list(self.peers):
            self._send(rank, DONE if failure is None else FAIL, (failure or "").encode())
