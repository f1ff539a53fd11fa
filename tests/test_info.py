"""`mlx-tfm info` and the BLAS routing it reports."""

import os
import subprocess
import sys

from mlx_tfm.blas import CANDIDATES


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlx_tfm", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def test_info_reports_an_optimized_blas_when_one_is_installed():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    assert "mlx " in result.stdout and "default device" in result.stdout
    installed = [p for p in CANDIDATES if os.path.exists(p)]
    if sys.platform.startswith("linux"):
        # CI installs libopenblas0-pthread (.ci/run); without it this must say so, not pass.
        assert installed, "no optimized BLAS installed: run .ci/run or apt-get install libopenblas0-pthread"
        assert f"OpenBLAS ({installed[0]})" in result.stdout


def test_optimized_blas_is_faster_than_the_bundled_reference():
    code = "from mlx_tfm.cli.info import matmul_gflops; print(matmul_gflops(512, 3))"
    fast = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    slow = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "MLX_TFM_BLAS": "reference"},
    )
    # Typically 30x; 3x leaves room for a busy machine while still proving the routing.
    assert float(fast.stdout) > 3 * float(slow.stdout)


def test_reference_blas_can_be_forced_and_is_reported():
    result = run_cli("info", env={"MLX_TFM_BLAS": "reference"})
    assert "reference BLAS (MLX_TFM_BLAS=reference)" in result.stdout


def test_importing_mlx_first_is_reported_not_crashed():
    code = "import mlx.core, mlx_tfm; from mlx_tfm.blas import blas_description; print(blas_description())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "import mlx_tfm first" in result.stdout


def test_no_subcommand_prints_help_and_fails():
    result = run_cli()
    assert result.returncode == 2
    assert "COMMAND" in result.stdout
