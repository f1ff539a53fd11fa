"""The one switch for the CPU routes.

``on_cpu()`` is true while MLX computes on its CPU backend and the routes are enabled; the
CPU layers and the attention dispatch ask it at every call, so flipping it sends a model
through the plain MLX routes (what Metal and CUDA run) on the same weights. Set
``MLX_TFM_CPU_ROUTES=0`` to start with them off; tests use ``generic_routes()``.
"""

from __future__ import annotations

import contextlib
import os

import mlx.core as mx

ENV_VAR = "MLX_TFM_CPU_ROUTES"
_enabled = os.environ.get(ENV_VAR, "1") != "0"


def on_cpu() -> bool:
    """Whether the CPU-specific routes run now."""
    return _enabled and mx.default_device() == mx.cpu


def routes_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def generic_routes():
    """Within the block every layer takes its plain MLX route, as on Metal or CUDA."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
