"""The ranks of one run: joining them (guarded), and what every command asks of them.

``join()`` is called once by a command that can run on several processes. Without a
launcher (or with one host) it returns the one-process world and changes nothing. Under
``mlx.launch`` it:

1. holds the roll call over the control connections (``control.py``): a rank that never
   comes is named within ``MLX_TFM_DISTRIBUTED_TIMEOUT`` seconds (default 60);
2. starts the watch, so a rank that dies from here on ends the others with one line;
3. enters ``mx.distributed.init`` with a timer: if MLX's ring has not formed within the
   timeout (ports blocked, a wrong address), the rank says so and exits;
4. quiets the followers: rank 0 prints and writes; the other ranks print nothing but
   their errors (marked ``[rank N]``), and ignore Ctrl-C (rank 0 decides).

``command_ended(code, failure)`` (called by the CLI once a command returns; at exit for
a script) tells the other ranks whether this one finished or why it failed.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from . import control
from .control import ControlLink, stop_process
from .launch import Launch, launch_from

# How long an error from MLX's ring waits for the watch to name the rank that went away.
RING_ERROR_GRACE_S = 3.0


@dataclass
class World:
    """This process's rank among ``size``; ``group`` is MLX's (None for one process)."""

    rank: int = 0
    size: int = 1
    group: object = None  # mx.distributed.Group
    link: ControlLink | None = field(default=None, repr=False)

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that reads input, prints, serves and writes files."""
        return self.rank == 0

    def share(self, value=None):
        """Rank 0's ``value`` on every rank (picklable: plain values, mlx_tfm's classes)."""
        if self.link is None:
            return value
        if self.leader:
            self.link.send(value)
            return value
        return self.link.receive()

    def share_arrays(self, tree: dict | None) -> dict:
        """Rank 0's tree of arrays on every rank (the others pass None): names, shapes and
        dtypes over the control connection, the values through MLX's ring (an all-sum in
        which the others add zeros, so every rank ends with exactly rank 0's values)."""
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_unflatten

        if self.group is None:
            return tree
        flat = tree_flatten(tree) if self.leader else None
        layout = self.share([(name, a.shape, str(a.dtype).removeprefix("mlx.core.")) for name, a in flat]
                            if self.leader else None)
        values = []
        for i, (name, shape, dtype) in enumerate(layout):
            mine = flat[i][1] if self.leader else mx.zeros(shape, getattr(mx, dtype))
            values.append((name, mx.distributed.all_sum(mine, group=self.group)))
            mx.eval(values[-1][1])
        return tree_unflatten(values)

    def start_alike(self, model, trainable_only: bool = True) -> None:
        """Every rank's ``model`` takes rank 0's parameters (the trainable ones, or all):
        data-parallel ranks must start from the same weights to stay the same."""
        if self.group is None:
            return
        mine = (model.trainable_parameters() if trainable_only else model.parameters()) if self.leader else None
        model.update(self.share_arrays(mine))

    def check_divides(self, batch_size: int, flag: str = "--batch-size") -> None:
        if batch_size % self.size:
            raise UserError(f"{flag} {batch_size} cannot be split evenly over {self.size} ranks: each rank takes an "
                            f"equal share of every batch; use a multiple of {self.size}")

    def rows(self, batch):
        """This rank's share of a batch's rows (``training.data.Batch``): ranks take
        consecutive equal blocks; a batch that does not split evenly (a short last
        validation batch) is split as evenly as it goes; None when this rank gets no row."""
        if self.size == 1:
            return batch
        parts = np.array_split(np.arange(len(batch.tokens)), self.size)[self.rank]
        if len(parts) == 0:
            return None
        return type(batch)(batch.tokens[parts[0] : parts[-1] + 1], batch.lengths[parts[0] : parts[-1] + 1])

    def rows_of(self, batches) -> list:
        """This rank's shares of a list of batches (those it gets none of left out)."""
        return [share for share in (self.rows(b) for b in batches) if share is not None]


ONE_PROCESS = World()
_joined: World | None = None


def current() -> World:
    """The world ``join()`` made, or the one-process world."""
    return _joined or ONE_PROCESS


def join() -> World:
    """Join the ranks this process was launched with (see the module docstring); the
    one-process world when there is no launch. Idempotent."""
    global _joined
    if _joined is not None:
        return _joined
    launch = launch_from()
    if launch is None:
        _joined = ONE_PROCESS
        return _joined
    link = ControlLink(launch)
    link.connect()
    link.watch()
    try:
        group = init_guarded(launch)
    except UserError as e:
        link.end(str(e))  # the others learn why, not only that this rank left
        raise
    _joined = World(launch.rank, launch.size, group, link)
    sys.excepthook = _reporting_excepthook(sys.excepthook)
    atexit.register(command_ended, 0)  # a script that simply ends has finished (the CLI says so itself)
    if launch.rank > 0:
        quiet_follower(launch.rank)
    return _joined


def init_guarded(launch: Launch):
    """``mx.distributed.init`` for the launch's backend, ended with a line if the ring has
    not formed within the timeout (MLX waits forever on a peer that never accepts)."""
    import mlx.core as mx

    formed = threading.Event()

    def give_up() -> None:
        if not formed.wait(launch.timeout_s):
            stop_process(f"rank {launch.rank}: MLX's {launch.backend} group did not form within "
                         f"{launch.timeout_s:g} s (are the hostfile's addresses and ports reachable?)")

    threading.Thread(target=give_up, name="mlx-tfm-init-timer", daemon=True).start()
    try:
        group = mx.distributed.init(strict=True, backend=launch.backend)
    except RuntimeError as e:
        raise UserError(f"rank {launch.rank} could not join MLX's {launch.backend} group: {e}") from None
    finally:
        formed.set()
    if group.size() != launch.size or group.rank() != launch.rank:
        raise UserError(f"MLX formed a group of {group.size()} with this process as rank {group.rank()}, "
                        f"but the launch says rank {launch.rank} of {launch.size}")
    return group


class RankPrefixed:
    """A follower's error lines, on the stderr it started with: each starts ``[rank N] ``."""

    def __init__(self, stream, rank: int):
        self.stream, self.prefix, self.at_line_start = stream, f"[rank {rank}] ", True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            self.stream.write((self.prefix if self.at_line_start else "") + piece)
            self.at_line_start = piece.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def quiet_follower(rank: int) -> None:
    control.errors_to = RankPrefixed(sys.stderr, rank)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _reporting_excepthook(previous):
    """An exception nobody caught: tell the other ranks, and when it is MLX's ring losing
    a peer, give the watch a moment to name the rank (it ends the process) before the
    traceback."""

    def hook(kind, error, traceback) -> None:
        message = str(error).splitlines()[0] if str(error) else ""
        if kind is RuntimeError and message.startswith("[ring]"):
            time.sleep(RING_ERROR_GRACE_S)
            command_ended(1, f"lost its connection to another rank ({message})")
            stop_process(f"rank {current().rank} lost its connection to another rank ({message})")
        command_ended(1, f"{kind.__name__}: {message}" if message else kind.__name__)
        if control.errors_to is not None:  # a follower: its stderr is silenced, not its traceback
            sys.stderr = control.errors_to
        previous(kind, error, traceback)

    return hook


def command_ended(code: int, failure: str | None = None) -> None:
    """A command is over on this rank: tell the others it finished (code 0) or why not
    (a follower also prints why, its own output being silenced)."""
    if _joined is None or _joined.link is None or _joined.link.ended:
        return
    reason = None if code == 0 else (failure or f"exit status {code}")
    if reason is not None and control.errors_to is not None:
        control.say(reason)
    _joined.link.end(reason)
