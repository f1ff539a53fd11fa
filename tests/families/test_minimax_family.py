"""MiniMax-Text-01 (mlx_tfm/families/minimax.py) on a prompt over several chunks of its
lightning attention: 150 positions against transformers (whose blocks are 16 positions,
ours 64: the same recurrence cut differently), greedy tokens equal."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from fixtures.convert_helpers import greedy, hf_greedy, hf_logits, make_hf_model

from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

LONG_PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 256, size=150)]
QUIET = dict(log=lambda *_: None)


def test_long_prompt_matches_transformers(tmp_path):
    hf = make_hf_model("minimax", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    assert model.args.linear_chunk_size < len(LONG_PROMPT)
    ours = np.array(model(mx.array([LONG_PROMPT]))[0].astype(mx.float32))
    np.testing.assert_allclose(ours, hf_logits(hf, LONG_PROMPT), atol=1e-4, rtol=0)
    assert greedy(model, LONG_PROMPT, 6) == hf_greedy(hf, LONG_PROMPT, 6)
