"""`mlx-tfm info` and the BLAS routing it reports. These tests pass with and without an
optimized BLAS installed: the routing is proven with a stand-in library, and its speed is
measured by `mlx-tfm info --matmul-benchmark` (docs/linux-cpu.md, "An optimized BLAS"), not asserted."""

import os
import subprocess
import sys

import pytest

from mlx_tfm.blas import CANDIDATES

# A stand-in BLAS whose sgemm writes 42 everywhere: a product that comes out as 42s ran
# through it, one that comes out right ran through another BLAS.
STAND_IN_SGEMM = r"""
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            c[order == 101 ? i * ldc + j : j * ldc + i] = 42.0f;
}
"""

PRODUCT = "import mlx_tfm, mlx.core as mx; print((mx.ones((3, 5)) @ mx.ones((5, 4)))[0, 0].item())"


def clean_env(**changes):
    env = {k: v for k, v in os.environ.items() if k != "MLX_TFM_BLAS"}
    return {**env, **changes}


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mlx_tfm", *args], capture_output=True, text=True,
                          env=env or clean_env())


def product_through(env) -> float:
    result = subprocess.run([sys.executable, "-c", PRODUCT], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return float(result.stdout)


@pytest.fixture(scope="module")
def stand_in_blas(tmp_path_factory):
    folder = tmp_path_factory.mktemp("blas")
    (folder / "sgemm.c").write_text(STAND_IN_SGEMM)
    library = folder / "libstandin.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(library), str(folder / "sgemm.c")], check=True)
    return library


def test_info_reports_the_blas_this_machine_has():
    """The optimized BLAS if one is installed, else the bundled one and how to get one."""
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    assert "mlx " in result.stdout and "default device" in result.stdout
    installed = [p for p in CANDIDATES if os.path.exists(p)]
    if not sys.platform.startswith("linux"):
        assert "OpenBLAS" not in result.stdout
    elif installed:
        assert f"OpenBLAS ({installed[0]}" in result.stdout
    else:
        assert "reference BLAS (no optimized BLAS found (install libopenblas0-pthread))" in result.stdout


def test_matrix_products_run_through_the_routed_blas(stand_in_blas):
    routed = clean_env(MLX_TFM_BLAS=str(stand_in_blas))
    if not sys.platform.startswith("linux"):  # Accelerate or Metal: nothing is routed
        assert product_through(routed) == 5.0
        return
    assert product_through(routed) == 42.0
    assert f"({stand_in_blas})" in run_cli("info", env=routed).stdout


def test_reference_blas_can_be_forced_and_is_reported():
    forced = clean_env(MLX_TFM_BLAS="reference")
    assert product_through(forced) == 5.0
    assert "reference BLAS (MLX_TFM_BLAS=reference)" in run_cli("info", env=forced).stdout


def test_a_missing_blas_library_is_reported_and_products_stay_right(tmp_path):
    missing = clean_env(MLX_TFM_BLAS=str(tmp_path / "libnothing.so"))
    assert product_through(missing) == 5.0
    assert "reference BLAS (no optimized BLAS found" in run_cli("info", env=missing).stdout


def test_importing_mlx_first_is_reported_not_crashed():
    code = "import mlx.core, mlx_tfm; from mlx_tfm.blas import blas_description; print(blas_description())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "import mlx_tfm first" in result.stdout


def test_no_subcommand_prints_help_and_fails():
    result = run_cli()
    assert result.returncode == 2
    assert "COMMAND" in result.stdout


CORE = "from mlx_tfm import blas; print(blas.openblas_core())"


def openblas_core_through(env) -> str:
    result = subprocess.run([sys.executable, "-c", CORE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_core_type_follows_the_instruction_sets():
    from mlx_tfm.blas import core_type

    avx512 = {"avx2", "fma", "avx512f", "avx512vl", "avx512bw", "avx512dq"}
    assert core_type(avx512 | {"avx512_bf16"}) == "Cooperlake"
    assert core_type(avx512) == "SkylakeX"
    assert core_type({"avx2", "fma", "sse3"}) == "Haswell"
    assert core_type({"sse3", "ssse3"}) is None  # OpenBLAS's own choice stands
    assert core_type(set()) is None  # arm64's flags name none of these


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS routing is Linux-only; macOS uses Accelerate")
def test_openblas_runs_the_kernels_the_cpu_can():
    """OpenBLAS 0.3.21 takes this project's Xeon machines for a 2004 Prescott (SSE3 kernels,
    4-5x slower); mlx_tfm names the kernels from the CPU's instruction sets, and a user's
    OPENBLAS_CORETYPE wins."""
    from mlx_tfm.blas import core_type, cpu_flags

    installed = [p for p in CANDIDATES if os.path.exists(p)]
    assert installed, "no OpenBLAS installed (apt-get install libopenblas0-pthread; .ci/run does)"
    env = {k: v for k, v in clean_env().items() if k != "OPENBLAS_CORETYPE"}
    expected = core_type(cpu_flags())
    assert expected is not None, "this test needs an x86-64 CPU with AVX2"
    assert openblas_core_through(env) == expected
    assert openblas_core_through({**env, "OPENBLAS_CORETYPE": "Haswell"}) == "Haswell"
    result = run_cli("info", env=env)
    assert f"{expected} kernels" in result.stdout
