"""`mlx-tfm info`: what MLX runs on here, and with which BLAS."""

from __future__ import annotations

import os
import platform

HELP = "Show the MLX version, default device, memory, which BLAS MLX uses and whether the CPU kernels run."


def add_arguments(parser) -> None:
    parser.add_argument("--matmul-benchmark", action="store_true", help="time a 1024x1024 float32 matmul (GFLOP/s)")


def system_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    import time

    import mlx.core as mx

    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a @ b)  # warm up
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * n**3 / seconds / 1e9


def collect() -> dict[str, str]:
    import mlx.core as mx

    from .. import __version__
    from ..blas import blas_description

    info = {
        "mlx_tfm": __version__,
        "mlx": mx.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "default device": str(mx.default_device()),
    }
    device = mx.device_info()
    if "device_name" in device:
        info["device name"] = str(device["device_name"])
    memory = device.get("memory_size") or system_memory_bytes()
    if memory:
        info["memory"] = f"{memory / 2**30:.1f} GiB"
    info["blas"] = blas_description()
    info["cpu kernels"] = kernels_description(mx.default_device())
    return info


def kernels_description(device) -> str:
    """Whether mlx_tfm's C++ CPU kernels run, and why not (they never do on Metal or CUDA)."""
    import mlx.core as mx

    from ..cpu.kernels import status

    if device != mx.cpu:
        return f"not used on {device} (CPU only); on the CPU: {status()}"
    return status()


def run(args) -> int:
    info = collect()
    if args.matmul_benchmark:
        info["matmul 1024x1024 f32"] = f"{matmul_gflops():.1f} GFLOP/s"
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0
