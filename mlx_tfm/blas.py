"""Route MLX's CPU matrix products to an optimized BLAS on Linux.

The ``mlx[cpu]`` wheel resolves its ``cblas_*``/``sgemm_`` symbols against a bundled
reference BLAS (a few GFLOP/s). Symbols already loaded with ``RTLD_GLOBAL`` win the
dynamic linker's lookup, so loading an optimized OpenBLAS *before* ``mlx.core`` is first
imported makes every MLX matmul use it (about 30x on a 1024x1024 float32 product here).

Only distribution builds are tried: they select their kernels at run time for the CPU
they find, so they never die with 'Illegal instruction' on a machine lacking AVX-512.
That run-time choice goes by the CPU's model number, and on a CPU it does not know (a
newer one, or a virtual machine that hides the model) it falls back to its oldest x86-64
kernels ("Prescott", SSE3): Debian's OpenBLAS 0.3.21 does so on this project's Xeon
machines, four to five times slower than its AVX-512 kernels. So the kernels are chosen
here from the instruction sets the CPU reports (``OPENBLAS_CORETYPE``, read when the
library loads), unless the user set that variable. On macOS MLX uses Accelerate and
Metal; nothing is done there.
"""

from __future__ import annotations

import ctypes
import os
import sys

# Searched in order; the first that loads wins. pthread builds first: MLX runs its own
# CPU work on threads, and OpenMP builds can oversubscribe with them.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

# OpenBLAS kernel families by the x86-64 instruction sets they need, best first; each is in
# every OpenBLAS release since 0.3.10 built with DYNAMIC_ARCH (Debian's, Fedora's).
CORE_TYPES = (
    ("Cooperlake", {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"}),
    ("SkylakeX", {"avx512f", "avx512vl", "avx512bw", "avx512dq"}),
    ("Haswell", {"avx2", "fma"}),
)
CORE_TYPE_VAR = "OPENBLAS_CORETYPE"

# Set MLX_TFM_BLAS=reference to keep MLX's bundled BLAS, or to a path to load that library.
ENV_VAR = "MLX_TFM_BLAS"

_loaded: str | None = None
_reason: str = "not attempted"


def route_blas() -> str | None:
    """Load an optimized BLAS globally if one is installed; return its path or None."""
    global _loaded, _reason
    if _loaded is not None or _reason != "not attempted":
        return _loaded
    if not sys.platform.startswith("linux"):
        _reason = "not Linux: MLX uses Accelerate/Metal"
        return None
    if "mlx.core" in sys.modules:
        _reason = "mlx.core was imported before mlx_tfm; import mlx_tfm first"
        return None
    choice = os.environ.get(ENV_VAR, "")
    if choice == "reference":
        _reason = f"{ENV_VAR}=reference"
        return None
    for path in ([choice] if choice else CANDIDATES):
        if not os.path.exists(path):
            continue
        if CORE_TYPE_VAR not in os.environ and core_type(cpu_flags()):
            os.environ[CORE_TYPE_VAR] = core_type(cpu_flags())
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            _reason = f"{path} failed to load: {e}"
            continue
        _loaded = path
        _reason = "loaded"
        return path
    if _reason == "not attempted":
        _reason = "no optimized BLAS found (install libopenblas0-pthread)"
    return None


def cpu_flags() -> set[str]:
    """The instruction sets the CPU reports (Linux's /proc/cpuinfo ``flags``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def core_type(flags: set[str]) -> str | None:
    """The best OpenBLAS kernel family whose instructions ``flags`` has (None: leave
    OpenBLAS's own choice, e.g. on arm64)."""
    return next((name for name, needs in CORE_TYPES if needs <= flags), None)


def openblas_core() -> str | None:
    """The kernel family the loaded OpenBLAS runs (``openblas_get_corename``)."""
    if not _loaded:
        return None
    try:
        corename = ctypes.CDLL(_loaded).openblas_get_corename
    except (OSError, AttributeError):
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode()


def blas_description() -> str:
    """One line for `mlx-tfm info`: which BLAS MLX's CPU matmuls use, its kernels, and why."""
    if _loaded:
        core = openblas_core()
        return f"OpenBLAS ({_loaded}; {core} kernels)" if core else f"OpenBLAS ({_loaded})"
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    return f"MLX's bundled reference BLAS ({_reason})"
