"""setup.py's build of the CPU kernels as a user meets it under pip: a line up front and a
line per compiled file reach the terminal (pip hides a build backend's output), a second
build of the same sources reuses the first, a failure is a warning naming the compiler's
error, and the build is skipped where the kernels are never called (macOS) or switched off.

A stand-in ``cmake`` on PATH plays CMake (it prints CMake's progress lines and writes a
library file), so these run in seconds and test setup.py, not the compiler."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from fixtures.project_builds import ROOT, copy_project, run_in_terminal, wheel_command

STAND_IN_CMAKE = r"""#!/bin/sh
echo "$*" >> "$CMAKE_CALLS"
if [ "$1" = "--build" ]; then
  echo "[ 25%] Building CXX object CMakeFiles/mlx_tfm_isa.dir/src/kernels_avx2.cpp.o"
  if [ -n "$CMAKE_FAILS" ]; then echo "primitives.cpp:12:3: error: $CMAKE_FAILS"; exit 2; fi
  echo "[ 50%] Building CXX object CMakeFiles/nanobind-static.dir/Unity/unity_0_cxx.cxx.o"
  echo "[100%] Linking CXX shared module _kernels.cpython-311-x86_64-linux-gnu.so"
  echo "a library" > "$2/_kernels.so"
else
  echo "-- Build files have been written to: the build folder"
fi
"""


def load_setup_helpers():
    """setup.py as a module (not as __main__: its setup() call is not run)."""
    spec = importlib.util.spec_from_file_location("mlx_tfm_setup_script", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def build_env(tmp_path) -> dict:
    """The environment of a build with the stand-in cmake first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(STAND_IN_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MLX_TFM_BUILD_KERNELS"}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "CMAKE_CALLS": str(tmp_path / "cmake-calls"),
            "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def build_in_terminal(project: Path, wheels: Path, env: dict) -> str:
    status, shown = run_in_terminal(wheel_command(project, wheels), env)
    assert status == 0, shown
    return shown


def test_a_build_under_pip_shows_itself_on_the_terminal_and_reuses_itself(tmp_path, build_env):
    project = copy_project(tmp_path / "project")
    first = build_in_terminal(project, tmp_path / "wheels-1", build_env)
    assert re.search(r"building mlx_tfm's CPU kernels \(takes ~\d+ minutes? on \d+ cores; "
                     r"MLX_TFM_BUILD_KERNELS=0 skips them\)", first), first
    assert "mlx_tfm: compiling kernels_avx2.cpp [25%]" in first and "compiling nanobind [50%]" in first, first
    # below pip's own line, not over it
    assert re.search(r"Building wheel for mlx-tfm \(pyproject.toml\) \.\.\.[^\r\n]*\r\nmlx_tfm: building", first)
    calls = Path(build_env["CMAKE_CALLS"]).read_text().splitlines()
    assert [call.split()[0] for call in calls] == ["-S", "--build"]

    again = build_in_terminal(project, tmp_path / "wheels-2", build_env)  # as `pip install -e ".[server]"` next
    assert "reusing build/mlx_tfm_kernels/" in again and "building mlx_tfm's CPU kernels" not in again, again
    assert Path(build_env["CMAKE_CALLS"]).read_text().splitlines() == calls  # CMake never ran again


def test_an_edited_source_is_built_again(tmp_path, build_env):
    project = copy_project(tmp_path / "project")
    build_in_terminal(project, tmp_path / "wheels-1", build_env)
    with open(project / "mlx_tfm" / "cpu" / "kernels" / "src" / "dispatch.cpp", "a") as source:
        source.write("\n// edited\n")
    again = build_in_terminal(project, tmp_path / "wheels-2", build_env)
    assert "building mlx_tfm's CPU kernels" in again and "reusing" not in again, again


def test_a_failed_build_is_a_warning_on_the_terminal_naming_the_error(tmp_path, build_env):
    project = copy_project(tmp_path / "project")
    shown = build_in_terminal(project, tmp_path / "wheels", {**build_env, "CMAKE_FAILS": "no member named 'x'"})
    assert ("warning: mlx_tfm's CPU kernels were not built (primitives.cpp:12:3: error: no member named 'x'); "
            "the pure-MLX routes will run") in shown, shown
    assert not (project / "build" / "mlx_tfm_kernels").exists() or not any(
        (project / "build" / "mlx_tfm_kernels").rglob("_kernels*"))


def test_switched_off_the_build_says_so_on_the_terminal(tmp_path, build_env):
    project = copy_project(tmp_path / "project")
    shown = build_in_terminal(project, tmp_path / "wheels", {**build_env, "MLX_TFM_BUILD_KERNELS": "0"})
    assert "MLX_TFM_BUILD_KERNELS=0, not building the CPU kernels" in shown, shown
    assert not Path(build_env["CMAKE_CALLS"]).exists()


@pytest.mark.parametrize("platform_name,expected", [
    ("darwin", "not building the CPU kernels on macOS: MLX runs on Metal there and never calls them"),
    ("win32", "not building the CPU kernels on win32: they are built for Linux only"),
    ("linux", None),
])
def test_the_kernels_are_built_on_linux_only(platform_name, expected):
    reason = load_setup_helpers().skipped_because(platform_name, {})
    assert reason == (expected and f"mlx_tfm: {expected}")


def test_the_build_key_follows_what_the_library_is_built_from(monkeypatch):
    setup_script = load_setup_helpers()
    settings = ["-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"]
    key = setup_script.build_key(settings)
    assert setup_script.build_key(list(settings)) == key
    assert setup_script.build_key(["-DCMAKE_BUILD_TYPE=Debug", settings[1]]) != key
    monkeypatch.setattr(setup_script, "installed_version", lambda name: "0.0.1" if name == "mlx" else "3.1.0")
    assert setup_script.build_key(settings) != key  # another mlx: other headers, another libmlx
