"""The one switch for the CPU routes.

``on_cpu()`` is true while MLX computes on its CPU backend and the routes are enabled; the
CPU layers and the attention dispatch ask it at every call, so flipping it sends a model
through the plain MLX routes (what Metal and CUDA run) on the same weights. Set
``MLX_TFM_CPU_ROUTES=0`` to start with them off; tests use ``generic_routes()``.

``int8_activations()``: whether the kernels' quantized decoding products round their input
to int8 (per 32 values, as llama.cpp's Q8_0) and multiply in integers. Off by default: it
changes results slightly (docs/cpu-kernels.md). ``MLX_TFM_INT8_ACTIVATIONS=1`` turns it on,
as does ``--int8-activations`` (``use_int8_activations``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import mlx.core as mx

from ..errors import UserError

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


_prompt_layer_by_layer = contextvars.ContextVar("mlx_tfm_prompt_layer_by_layer", default=False)


@contextlib.contextmanager
def prompt_layer_by_layer():
    """Within the block (this thread's), a chunk of several positions through a model
    evaluates each sublayer's output (attention's, then the FFN's) before the next one's
    graph is built, on the CPU. MLX's CPU backend allocates the outputs of the operations
    queued ahead of the one computing, and the kernels make a layer a few large operations,
    so otherwise several layers' activations of a prompt are alive at once (and, a layer
    at a time, attention's and the FFN's together). For reading prompts only (generate's
    prefill, the engine's): never around a gradient or a compiled function."""
    token = _prompt_layer_by_layer.set(True)
    try:
        yield
    finally:
        _prompt_layer_by_layer.reset(token)


def evaluates_each_sublayer() -> bool:
    return _prompt_layer_by_layer.get() and on_cpu()


INT8_ENV_VAR = "MLX_TFM_INT8_ACTIVATIONS"
_int8_activations: bool | None = None  # None: not read from the environment yet


def int8_activations() -> bool:
    """Whether the kernels' quantized decoding products take int8 activations; a value of
    ``MLX_TFM_INT8_ACTIVATIONS`` other than 0 or 1 is a UserError."""
    global _int8_activations
    if _int8_activations is None:
        value = os.environ.get(INT8_ENV_VAR, "0")
        if value not in ("0", "1"):
            raise UserError(f"{INT8_ENV_VAR}={value}: use 1 (int8 activations in quantized decoding) or 0 (off)")
        _int8_activations = value == "1"
    return _int8_activations


def use_int8_activations(on: bool) -> None:
    """Sets ``int8_activations()`` for the rest of the process (``--int8-activations``)."""
    global _int8_activations
    _int8_activations = on


@contextlib.contextmanager
def int8_activations_set(on: bool):
    """Within the block ``int8_activations()`` is ``on`` (tests, benchmarks)."""
    global _int8_activations
    before = int8_activations()
    _int8_activations = on
    try:
        yield
    finally:
        _int8_activations = before
