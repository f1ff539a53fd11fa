"""Shared fixtures. ``mlx_tfm`` is imported before MLX so the optimized BLAS routing runs
first, as it does for users."""

import os
import tempfile
from pathlib import Path

import mlx_tfm  # noqa: F401  (routes BLAS before mlx.core loads)
import pytest

# The fixtures kept in the repository (tests/data, SOURCES.md there says where each comes
# from and its license), or wherever MLX_TFM_TEST_DATA points.
DATA = Path(os.environ.get("MLX_TFM_TEST_DATA") or Path(__file__).resolve().parent / "data")

# Conversions and loads record themselves in the registry `mlx-tfm list` reads
# (weights/catalog.py); the tests' go to a throwaway one, never the user's (subprocesses inherit it).
os.environ["MLX_TFM_MODELS_REGISTRY"] = str(Path(tempfile.mkdtemp(prefix="mlx-tfm-registry-")) / "models.json")


def data_path(*parts: str) -> Path:
    """A fixture file from the test data folder; a missing one fails the test loudly."""
    path = DATA.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"test fixture {path} is missing: the tests read tests/data (or the folder "
                    "MLX_TFM_TEST_DATA names)")
    return path


@pytest.fixture(scope="session")
def stories_hf() -> Path:
    return data_path("stories260K-hf")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return data_path("stories260K")


@pytest.fixture(scope="session")
def golden(stories_dir) -> dict:
    import json

    return json.loads((stories_dir / "greedy_reference.json").read_text())
