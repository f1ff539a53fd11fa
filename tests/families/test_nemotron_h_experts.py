"""Nemotron-H's experts layers (mlx_tfm/families/state_space.py, model/experts.py
SwitchMLP): ungated squared-ReLU experts behind a grouped sigmoid router with its choice
bias, and a shared expert. Against transformers on a prompt over many SSD chunks with a
non-zero choice bias (the random init leaves that buffer at zero), cached decoding equal to
a full forward, and the configurations refused."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.convert_helpers import TINY_CONFIGS, hf_logits, make_hf_model

from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.loading import load_model

LONG_PROMPT = [(7 * i + 3) % 256 for i in range(41)]  # ten chunks of 4, and one position more
QUIET = dict(log=lambda *_: None)


def our_logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def biased_model(tmp_path):
    """The tiny experts model with a random choice bias, saved again to ``tmp_path / "hf"``."""
    hf = make_hf_model("nemotron_h_moe", tmp_path / "hf", chunk_size=4)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.5)
    hf.save_pretrained(tmp_path / "hf")
    return hf


def test_experts_layers_match_transformers_with_a_choice_bias(tmp_path):
    hf = biased_model(tmp_path)
    args = model_args_from_config(hf.config.to_dict())
    assert args.ungated_experts and args.router_scoring == "sigmoid"
    assert [args.has_experts(i) for i in range(5)] == [False, True, False, False, True]
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    assert "gate_proj" not in model.model.layers[1].mlp.switch_mlp
    np.testing.assert_allclose(our_logits(model, LONG_PROMPT), hf_logits(hf, LONG_PROMPT), atol=1e-4, rtol=0)


def test_cached_decoding_equals_a_full_forward(tmp_path):
    make_hf_model("nemotron_h_moe", tmp_path / "hf", chunk_size=4)
    model, _ = load_model(tmp_path / "hf")
    ids = mx.array([LONG_PROMPT[:24]])
    cache = model.make_cache()
    pieces = [model(ids[:, :9], cache=cache), model(ids[:, 9:15], cache=cache)]
    pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(15, 24)]
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(model(ids)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_routed_experts=None), "nemotron_h layers of kind 'E' are not supported without n_routed_experts"),
    (dict(moe_latent_size=16), "nemotron_h experts with moe_latent_size"),
])
def test_refused_experts_configurations_are_one_line(overrides, message):
    config = {**TINY_CONFIGS["nemotron_h_moe"], **overrides}
    with pytest.raises(UserError, match=message):
        model_args_from_config(config)
