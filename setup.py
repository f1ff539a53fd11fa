"""Build hook for the optional C++ CPU kernels (mlx_tfm/cpu/kernels, see its CMakeLists.txt).

Everything else is declared in pyproject.toml. ``pip install -e .`` (or a wheel build)
configures and builds the extension with CMake against the mlx wheel's headers and
libmlx, and nanobind 3; where that cannot be done (no compiler or CMake, an unsupported
platform, ``MLX_TFM_BUILD_KERNELS=0``) it prints a warning and the install goes on
without them: mlx_tfm then runs its pure-MLX routes (``mlx-tfm info`` says so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS_SOURCE = Path(__file__).resolve().parent / "mlx_tfm" / "cpu" / "kernels"
SWITCH = "MLX_TFM_BUILD_KERNELS"


class OptionalCMakeBuild(build_ext):
    """Builds each CMake extension, warning instead of failing."""

    def run(self) -> None:
        if os.environ.get(SWITCH, "1") == "0":
            print(f"mlx_tfm: {SWITCH}=0, not building the CPU kernels", file=sys.stderr)
            return
        super().run()

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        try:
            built = self.cmake_build(Path(self.build_temp) / "mlx_tfm_kernels")
        except (OSError, subprocess.CalledProcessError) as error:
            print(f"warning: mlx_tfm's CPU kernels were not built ({error}); the pure-MLX routes will run",
                  file=sys.stderr)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)

    def cmake_build(self, build_dir: Path) -> Path:
        build_dir.mkdir(parents=True, exist_ok=True)
        if shutil.which("cmake") is None:
            raise OSError("cmake not found")
        subprocess.run(["cmake", "-S", str(KERNELS_SOURCE), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                        f"-DPython_EXECUTABLE={sys.executable}"], check=True)
        jobs = str(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)
        built = sorted(build_dir.glob("_kernels*.so")) + sorted(build_dir.glob("_kernels*.pyd"))
        if not built:
            raise OSError(f"no _kernels library in {build_dir}")
        return built[0]

    def copy_extensions_to_source(self) -> None:
        """In-place (editable) builds: copy what was built, skipping a build that failed."""
        inplace, self.inplace = self.inplace, 0  # where build_extension put it
        try:
            built = all(Path(self.get_ext_fullpath(ext.name)).is_file() for ext in self.extensions)
        finally:
            self.inplace = inplace
        if built:
            super().copy_extensions_to_source()

setup(
    ext_modules=[Extension("mlx_tfm.cpu.kernels._kernels", sources=[])],
    cmdclass={"build_ext": OptionalCMakeBuild},
)
