"""A pipeline over two ranks splits an LFM2 stack (conv and attention layers) like any
other: each rank makes StateCaches for its conv layers, and the logits and greedy tokens
equal the whole model's. Tensor parallelism refuses recurrent layers with one line."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import make_hf_model
from fixtures.ranks import run_ranks
from fixtures.recurrent_models import tiny_lfm2

from mlx_tfm.convert.converter import convert
from mlx_tfm.distributed.sharding import check_tensor_split
from mlx_tfm.errors import UserError
from mlx_tfm.generation.step import generate_step
from mlx_tfm.loading import load_model

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "recurrent_rank_script.py"
PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140]


def test_a_two_rank_pipeline_of_an_lfm2_stack_equals_the_whole_model(tmp_path):
    make_hf_model("lfm2", tmp_path / "hf")  # conv, attention, conv, attention
    convert(tmp_path / "hf", tmp_path / "mlx", log=lambda *_: None)
    ranks = run_ranks(tmp_path, [sys.executable, SCRIPT, tmp_path, tmp_path / "mlx"])
    assert [r.code for r in ranks] == [0, 0], ranks[0].err + ranks[1].err
    model, _ = load_model(tmp_path / "mlx")
    logits = np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))
    greedy = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12)]
    for rank in (0, 1):
        split = np.load(tmp_path / f"pipeline-{rank}.npz")
        assert split["kinds"].tolist() == ["StateCache", "KVCache"]  # two layers per rank
        np.testing.assert_array_equal(split["logits"], logits)
        assert split["greedy"].tolist() == greedy


def test_tensor_parallel_refuses_recurrent_layers():
    with pytest.raises(UserError, match=r"layer 0 is a 'conv' layer \(a recurrent state\); use --pipeline"):
        check_tensor_split(tiny_lfm2(), 2)
