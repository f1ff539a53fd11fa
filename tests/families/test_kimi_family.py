"""Kimi Linear (mlx_tfm/families/kimi.py) on a prompt longer than a chunk of the delta
rule: 150 positions (three chunks of 64) against transformers computed in float64, greedy
tokens equal, and the folders we write converting again unchanged."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from fixtures.convert_helpers import greedy, hf_greedy, make_hf_model

from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

LONG_PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 256, size=150)]
QUIET = dict(log=lambda *_: None)


def logits_of(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def float64_logits(hf, ids) -> np.ndarray:
    """transformers' logits in float64: the reference a float32 run of the chunked rule is
    held to over 150 positions."""
    import torch

    hf.set_experts_implementation("eager")  # the grouped products have no float64
    with torch.no_grad():
        return hf.double()(torch.tensor([ids])).logits[0].numpy()


def test_long_prompt_matches_transformers(tmp_path):
    hf = make_hf_model("kimi_linear", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    assert model.args.linear_chunk_size < len(LONG_PROMPT)
    expected_greedy = hf_greedy(hf, LONG_PROMPT, 6)
    np.testing.assert_allclose(logits_of(model, LONG_PROMPT), float64_logits(hf, LONG_PROMPT), atol=1e-4, rtol=0)
    assert greedy(model, LONG_PROMPT, 6) == expected_greedy


def test_our_folders_convert_again_unchanged(tmp_path):
    make_hf_model("kimi_linear", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    convert(tmp_path / "mlx", tmp_path / "again", **QUIET)
    first, _ = load_model(tmp_path / "mlx")
    second, _ = load_model(tmp_path / "again")
    np.testing.assert_array_equal(logits_of(second, LONG_PROMPT[:20]), logits_of(first, LONG_PROMPT[:20]))
