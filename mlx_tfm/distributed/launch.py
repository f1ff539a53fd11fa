"""What a launcher told this process: its rank, how many ranks there are, which of MLX's
backends joins them, and where rank 0 listens for our control connections.

``mlx.launch`` (and any launcher that does what it does) sets, for the ring backend,
``MLX_RANK`` and ``MLX_HOSTFILE`` (a file holding a JSON list, one entry per rank, of
that rank's ``"ip:port"`` addresses); for JACCL, ``MLX_RANK``, ``MLX_JACCL_COORDINATOR``
(``ip:port``) and ``MLX_IBV_DEVICES`` (a file holding one list of RDMA devices per rank).
MLX's own ``mx.distributed.init`` reads the same variables. Nothing here imports MLX.

The control address (``MLX_TFM_CONTROL_ADDRESS`` overrides it) is rank 0's first IP with
the port after the highest port of the ring (JACCL: after the coordinator's), so it never
takes a port the ring uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..errors import UserError
from ..jsonfile import parse_json

CONTROL_ADDRESS = "MLX_TFM_CONTROL_ADDRESS"
TIMEOUT = "MLX_TFM_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Launch:
    rank: int
    size: int
    backend: str  # "ring" | "jaccl": what mx.distributed.init is asked for
    control: tuple[str, int]  # rank 0's control address (host, port)
    timeout_s: float  # how long a rank may be missing or silent before the others give up


def split_address(text: str, where: str) -> tuple[str, int]:
    host, _, port = str(text).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{where}: {text!r} is not an ip:port address")
    return host.strip("[]"), int(port)


def read_json_file(variable: str, path: str):
    """The JSON a launcher wrote to the file a variable names; None for an empty file
    (mlx.launch writes an empty hostfile for a single host)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"{variable}={path} cannot be read ({e.strerror})") from None
    if not text.strip():
        return None
    return parse_json(text, f"{variable}={path}", expect=None)


def ring_hosts(path: str) -> list[list[tuple[str, int]]] | None:
    """The ring hostfile: per rank, its (ip, port) addresses; None for one host."""
    hosts = read_json_file("MLX_HOSTFILE", path)
    if hosts is None:
        return None
    if not isinstance(hosts, list) or not all(isinstance(h, list) and h for h in hosts):
        raise UserError(f"MLX_HOSTFILE={path} must hold a list with one list of \"ip:port\" per rank")
    return [[split_address(a, f"MLX_HOSTFILE={path}") for a in host] for host in hosts]


def read_timeout(env: Mapping[str, str]) -> float:
    text = env.get(TIMEOUT)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise UserError(f"{TIMEOUT} must be a number of seconds > 0, not {text!r}")
    return value


def launch_from(env: Mapping[str, str] = os.environ) -> Launch | None:
    """The launch this environment describes; None for a single process (no rank variable,
    or a hostfile with one host)."""
    if "MLX_RANK" not in env:
        return None
    rank_text = env["MLX_RANK"]
    if not rank_text.isdigit():
        raise UserError(f"MLX_RANK must be a whole number, not {rank_text!r}")
    rank = int(rank_text)
    if env.get("MLX_HOSTFILE"):
        hosts = ring_hosts(env["MLX_HOSTFILE"])
        if hosts is None:
            return None
        size, backend = len(hosts), "ring"
        control = (hosts[0][0][0], max(port for host in hosts for _, port in host) + 1)
    elif env.get("MLX_JACCL_COORDINATOR") and env.get("MLX_IBV_DEVICES"):
        devices = read_json_file("MLX_IBV_DEVICES", env["MLX_IBV_DEVICES"]) or []
        size, backend = len(devices), "jaccl"
        host, port = split_address(env["MLX_JACCL_COORDINATOR"], "MLX_JACCL_COORDINATOR")
        control = (host, port + 1)
    else:
        raise UserError("MLX_RANK is set but neither MLX_HOSTFILE (ring) nor MLX_JACCL_COORDINATOR and "
                        "MLX_IBV_DEVICES (JACCL) are: start the ranks with mlx.launch")
    if size < 2:
        return None
    if rank >= size:
        raise UserError(f"MLX_RANK is {rank} but the launch has {size} ranks (0..{size - 1})")
    if env.get(CONTROL_ADDRESS):
        control = split_address(env[CONTROL_ADDRESS], CONTROL_ADDRESS)
    return Launch(rank, size, backend, control, read_timeout(env))
