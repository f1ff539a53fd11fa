"""mlx_tfm's own CPU kernels: an optional C++ extension of MLX (``_kernels``, built by
``pip install -e .`` where a C++ compiler, CMake, nanobind 3 and the mlx wheel's headers are
at hand; sources and CMakeLists.txt beside this file).

The products of a few positions (decoding) that MLX's CPU backend runs slowly or on one
core: ``matvec`` (float32 / float16 / bfloat16 weights; ``dense=True`` for a prompt: x made
float32 once, float32 BLAS over blocks of the weight's rows made float32, in one call),
``quantized_matvec`` (MLX's affine 4- and 8-bit layout, group 32/64/128, float32 or
half-precision scales; ``dense=True`` for a prompt: float32 BLAS over blocks of dequantized
rows, in one call), ``fused_products``
(several products of one input in one call: q/k/v, optionally in attention's layout with
RoPE applied; gate/up with silu on the way out) and ``quantized_rows`` (a quantized
embedding lookup); attention (``attention``: a decoding step's query, a prompt's causal
chunk, an encoder's padded rows); and the pointwise ops MLX runs as chains of scalar ops (``rms_norm``, ``rope``, ``silu_mul``, ``logsumexp``).
Each is a lazy MLX operation (a ``Primitive`` with ``eval_cpu``; gradients through MLX's
own ops) that splits its work over a pool of one thread per core where it is large enough
and uses the widest SIMD the CPU has (AVX-512, AVX2, else portable loops the compiler
vectorizes, NEON on arm64), chosen at run time; ``MLX_TFM_KERNELS_ISA=avx512|avx2|generic``
picks one (for tests and comparisons), and a name it does not know or a set the CPU lacks
is a ``UserError`` (one line, a non-zero exit), never a quiet fallback to another set.

``kernels()`` is the module, or None when it is switched off (``MLX_TFM_KERNELS=0``), was
not built, fails to import, or was built against another mlx than the one installed (its
primitives would not match libmlx); ``status()`` says which and why (``mlx-tfm info``).
Whoever calls them falls back to the pure MLX routes then, and on Metal or CUDA always.
The kernels are built on Linux only: on macOS MLX runs on Metal and never calls them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from types import ModuleType

import mlx.core as mx

from ...errors import UserError

ENV_VAR = "MLX_TFM_KERNELS"
ISA_VAR = "MLX_TFM_KERNELS_ISA"
# The functions of the extension this module calls, by version (bindings.cpp's ``interface``;
# builds from before it had none: version 1).
INTERFACE = 6


def _loaded() -> tuple[ModuleType | None, str]:
    """The extension and a one-line account of it; UserError when ``MLX_TFM_KERNELS_ISA``
    names a set the kernels do not know or this CPU lacks."""
    module, account, refusal = _load()
    if refusal:
        raise UserError(refusal)
    return module, account


@functools.cache
def _load() -> tuple[ModuleType | None, str, str]:
    """(the extension or None, the account of it, why it must not run or '')."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None, f"off ({ENV_VAR}=0): pure MLX routes", ""
    if importlib.util.find_spec(f"{__name__}._kernels") is None:
        if sys.platform == "darwin":
            return None, "not built on macOS (MLX runs on Metal there): pure MLX routes on its CPU", ""
        return None, "not built: pure MLX routes; `pip install -e .` with a C++ compiler and CMake builds them", ""
    try:
        from . import _kernels
    except ImportError as error:  # e.g. libmlx changed under it
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        return None, f"not in use ({first_line}): pure MLX routes; `pip install -e .` rebuilds them", ""
    if _kernels.built_with_mlx != mx.__version__:
        return None, (f"not in use: built against mlx {_kernels.built_with_mlx}, mlx {mx.__version__} is installed: "
                      "pure MLX routes; `pip install -e .` rebuilds them"), ""
    if getattr(_kernels, "interface", 1) != INTERFACE:
        return None, "not in use: built from older sources: pure MLX routes; `pip install -e .` rebuilds them", ""
    if _kernels.isa_request_error():
        return None, "", _kernels.isa_request_error()
    return _kernels, f"in use ({_kernels.isa()}, {_kernels.threads()} threads)", ""


def kernels() -> ModuleType | None:
    """The kernels module, or None where the pure MLX routes must run (see ``status``)."""
    return _loaded()[0]


def status() -> str:
    """Whether the kernels are in use, and why not when they are not."""
    return _loaded()[1]


__all__ = ["kernels", "status", "ENV_VAR", "ISA_VAR"]
