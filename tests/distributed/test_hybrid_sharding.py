"""Tensor parallelism refuses the layer kinds whose weights it does not cut (Gated
DeltaNet, Mamba-2, Mamba, MLA, Falcon-H1's parallel Mamba) with one line naming the kind;
a two-rank pipeline of a Qwen3-Next-like and a DeepSeek-V3-like model gives the whole
model's logits and greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import make_hf_model
from fixtures.hybrid_models import tiny_family_model
from fixtures.ranks import run_ranks

from mlx_tfm.convert.converter import convert
from mlx_tfm.distributed.sharding import check_tensor_split
from mlx_tfm.errors import UserError
from mlx_tfm.generation.step import generate_step
from mlx_tfm.loading import load_model

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "recurrent_rank_script.py"
PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140]


@pytest.mark.parametrize("case,named", [
    ("qwen3_next", r"layer 0 is a 'linear_attention' layer \(a recurrent state\)"),
    ("mamba2", r"layer 0 is a 'mamba' layer \(a recurrent state\)"),
    ("mamba", r"layer 0 is a 'mamba1' layer \(a recurrent state\)"),
    ("deepseek_v3", r"layer 0 is MLA \(latent attention"),
    ("falcon_h1", r"layer 0 is attention with a Mamba-2 mixer beside it"),
])
def test_tensor_parallel_refuses_the_layer_kinds_it_cannot_split(case, named):
    with pytest.raises(UserError, match=named + ".*; use --pipeline$"):
        check_tensor_split(tiny_family_model(case), 2)


@pytest.mark.parametrize("family,kinds", [("qwen3_next", ["StateCache", "StateCache"]),
                                          ("deepseek_v3", ["KVCache"])])
def test_a_two_rank_pipeline_equals_the_whole_model(tmp_path, family, kinds):
    make_hf_model(family, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", log=lambda *_: None)
    ranks = run_ranks(tmp_path, [sys.executable, SCRIPT, tmp_path, tmp_path / "mlx"])
    assert [r.code for r in ranks] == [0, 0], ranks[0].err + ranks[1].err
    model, _ = load_model(tmp_path / "mlx")
    logits = np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))
    greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12)]
    for rank in (0, 1):
        split = np.load(tmp_path / f"pipeline-{rank}.npz")
        np.testing.assert_array_equal(split["logits"], logits)
        assert split["greedy"].tolist() == greedy
    first = np.load(tmp_path / "pipeline-0.npz")["kinds"].tolist()
    assert first == kinds
