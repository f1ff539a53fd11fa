"""Build hook for the optional C++ CPU kernels (mlx_tfm/cpu/kernels, see its CMakeLists.txt).

Everything else is declared in pyproject.toml. ``pip install -e .`` (or a wheel build)
configures and builds the extension with CMake against the mlx wheel's headers and
libmlx, and nanobind 3; where that cannot be done (no compiler or CMake, a failed build,
``MLX_TFM_BUILD_KERNELS=0``) it prints a warning and the install goes on without them:
mlx_tfm then runs its pure-MLX routes (``mlx-tfm info`` says so). They are built on Linux
only: on macOS MLX runs on Metal and never calls them.

pip shows a build backend's output only with ``-v`` or on failure, so the lines meant for
the user (the build starting, each file it compiles, a warning) also go to the terminal
(``/dev/tty``) when there is one. A build is kept under build/mlx_tfm_kernels/, by what it
was built from, so installing again (``pip install -e ".[server]"`` after ``-e .``) copies
it instead of compiling the same sources again.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
KERNELS_SOURCE = ROOT / "mlx_tfm" / "cpu" / "kernels"
KEPT_BUILDS = ROOT / "build" / "mlx_tfm_kernels"
SWITCH = "MLX_TFM_BUILD_KERNELS"
# About what a full build of the kernels takes on one core: the estimate users are shown.
BUILD_CPU_MINUTES = 2
# CMake's line as it starts a file: "[ 20%] Building CXX object ..." (Makefiles), "[3/18] ..." (Ninja).
COMPILING = re.compile(r"^\[\s*(\d+%|\d+/\d+)\]\s+Building CXX object\s+(\S+)")


class KernelBuildError(Exception):
    """A step of the kernels' build failed; the message says which and why."""


class Terminal:
    """The user's terminal, written to directly (pip captures stdout and stderr), where pip
    draws a spinner after its "Building ... ..." line."""

    def __init__(self) -> None:
        self.written = False

    def write(self, message: str) -> None:
        # The first line starts below pip's; the next ones start over the spinner's mark.
        start = "\r" if self.written else "\n"
        try:
            with open("/dev/tty", "w") as terminal:
                terminal.write(f"{start}{message}\n")
        except OSError:  # no controlling terminal (CI, a service): stderr only
            return
        self.written = True


TERMINAL = Terminal()


def tell(message: str) -> None:
    """One line for the user: on stderr, and on the terminal when stderr is not it."""
    print(message, file=sys.stderr, flush=True)
    if not sys.stderr.isatty():
        TERMINAL.write(message)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def skipped_because(platform_name: str, environ) -> str | None:
    """Why the kernels are not built on ``platform_name`` (``sys.platform``), or None."""
    if environ.get(SWITCH, "1") == "0":
        return f"mlx_tfm: {SWITCH}=0, not building the CPU kernels (the pure-MLX routes will run)"
    if platform_name == "darwin":
        return "mlx_tfm: not building the CPU kernels on macOS: MLX runs on Metal there and never calls them"
    if not platform_name.startswith("linux"):
        return f"mlx_tfm: not building the CPU kernels on {platform_name}: they are built for Linux only"
    return None


def compiler_identity() -> str:
    try:
        done = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True)
    except OSError:
        return "no compiler"
    return done.stdout.partition("\n")[0]


def installed_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def build_key(cmake_args: list[str]) -> str:
    """What a build of the kernels is made from: the sources, the compiler, the mlx and
    nanobind it is built against, the Python ABI and the CMake settings."""
    digest = hashlib.sha256()
    for path in [KERNELS_SOURCE / "CMakeLists.txt", *sorted((KERNELS_SOURCE / "src").rglob("*"))]:
        if path.is_file():
            digest.update(path.relative_to(KERNELS_SOURCE).as_posix().encode() + b"\0" + path.read_bytes())
    for part in (compiler_identity(), installed_version("mlx"), installed_version("nanobind"),
                 sysconfig.get_config_var("EXT_SUFFIX"), platform.machine(), os.environ.get("CXXFLAGS", ""),
                 *cmake_args):
        digest.update(f"{part}\0".encode())
    return digest.hexdigest()[:16]


def compiled_file(object_path: str) -> str:
    """'kernels_avx2.cpp' for CMake's object of it; 'nanobind' for nanobind's own sources."""
    return "nanobind" if "nanobind" in object_path else Path(object_path).name.removesuffix(".o")


def run_streamed(command: list[str], progress: bool = False) -> None:
    """Run a build step, its output passed on to stdout (what pip shows with -v; its spinner
    turns on each line); with ``progress``, tell each file as its compilation starts.
    KernelBuildError naming the first compiler error when the step fails."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace")
    first_error = None
    for line in process.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        started = COMPILING.match(line)
        if progress and started:
            tell(f"mlx_tfm: compiling {compiled_file(started.group(2))} [{started.group(1)}]")
        if first_error is None and ": error:" in line:
            first_error = line.strip()
    if process.wait() != 0:
        raise KernelBuildError(first_error or f"{' '.join(command[:2])} failed with status {process.returncode}")


def keep(built: Path, key: str) -> Path:
    """Keep a finished build under KEPT_BUILDS/key (the only one kept); its path there."""
    if KEPT_BUILDS.is_dir():
        for stale in KEPT_BUILDS.iterdir():
            if stale.name != key:
                shutil.rmtree(stale, ignore_errors=True)
    folder = KEPT_BUILDS / key
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{built.name}.partial"  # renamed once whole: never a half-copied library
    shutil.copyfile(built, partial)
    return Path(shutil.move(str(partial), str(folder / built.name)))


class OptionalCMakeBuild(build_ext):
    """Builds each CMake extension, warning instead of failing."""

    def run(self) -> None:
        reason = skipped_because(sys.platform, os.environ)
        if reason:
            tell(reason)
            return
        super().run()

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        try:
            built = self.kept_or_built(Path(self.build_temp) / "mlx_tfm_kernels")
        except (OSError, subprocess.CalledProcessError, KernelBuildError) as error:
            tell(f"warning: mlx_tfm's CPU kernels were not built ({error}); the pure-MLX routes will run")
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)

    def kept_or_built(self, build_dir: Path) -> Path:
        """The library kept from a build of the same sources and tools, else a new build."""
        settings = ["-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"]
        key = build_key(settings)  # not the build folder's path: a temporary one each time
        kept = sorted((KEPT_BUILDS / key).glob("_kernels*"))
        if kept:
            tell(f"mlx_tfm: the CPU kernels were built before from the same sources: reusing "
                 f"{kept[0].relative_to(ROOT)} (delete {KEPT_BUILDS.relative_to(ROOT)} to rebuild)")
            return kept[0]
        minutes = math.ceil(BUILD_CPU_MINUTES / cores())
        tell(f"mlx_tfm: building mlx_tfm's CPU kernels (takes ~{minutes} minute{'s' * (minutes > 1)} on {cores()} "
             f"cores; {SWITCH}=0 skips them)")
        return keep(self.cmake_build(build_dir, settings), key)

    def cmake_build(self, build_dir: Path, settings: list[str]) -> Path:
        build_dir.mkdir(parents=True, exist_ok=True)
        if shutil.which("cmake") is None:
            raise OSError("cmake not found")
        run_streamed(["cmake", "-S", str(KERNELS_SOURCE), "-B", str(build_dir), *settings])
        run_streamed(["cmake", "--build", str(build_dir), "--parallel", str(cores())], progress=True)
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


if __name__ == "__main__":  # as pip's build backend runs it too; tests import the helpers above
    setup(
        ext_modules=[Extension("mlx_tfm.cpu.kernels._kernels", sources=[])],
        cmdclass={"build_ext": OptionalCMakeBuild},
    )
