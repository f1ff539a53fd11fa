"""LFM2-MoE's expert bias, which the random init of the parity tests leaves at zero:
nonzero, it changes which experts run, and we follow transformers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.convert_helpers import TINY_CONFIGS, hf_logits

from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.loading import load_model

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77]


def test_expert_bias_steers_the_choice_as_in_transformers(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = dict(TINY_CONFIGS["lfm2_moe"])
    config = AutoConfig.for_model(keys.pop("model_type", "lfm2_moe"), **keys)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        for layer in hf.model.layers[1:]:
            layer.feed_forward.expert_bias.copy_(torch.tensor([0.0, 2.0, -2.0, 0.5]))
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", log=lambda *_: None)
    model, _ = load_model(tmp_path / "mlx")
    bias = model.layers[1].mlp.e_score_correction_bias
    assert bias.tolist() == [0.0, 2.0, -2.0, 0.5]
    ours = np.array(model(mx.array([PROMPT]))[0])
    np.testing.assert_allclose(ours, hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_lfm2_moe_without_expert_bias_is_refused():
    config = {**TINY_CONFIGS["lfm2_moe"], "model_type": "lfm2_moe", "use_expert_bias": False}
    with pytest.raises(UserError, match="use_expert_bias"):
        model_args_from_config(config)


def test_lfm2_feed_forward_width_and_layer_types_from_an_mlx_lm_config():
    """mlx-community LFM2 configs: block_ff_dim and full_attn_idxs, no layer_types."""
    config = {"model_type": "lfm2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "block_ff_dim": 200, "block_multiple_of": 32,
              "block_ffn_dim_multiplier": 1.5, "full_attn_idxs": [2]}
    args = model_args_from_config(config)
    assert args.layer_types == ("conv", "conv", "full_attention", "conv")
    assert args.intermediate_size == 224  # int(1.5 * int(2 * 200 / 3)) = 199, rounded up to 7 * 32


@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_folders_mlx_lm_writes_load_with_the_same_logits(name, tmp_path):
    """mlx-community's layout: mlx-lm's own sanitized weights (conv taps (D, K, 1), experts
    stacked, lfm2_moe's dense w1/w2/w3 renamed) and the config it writes."""
    import json

    from fixtures.convert_helpers import make_hf_model
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as mlx_lm_load_model
    from mlx_lm.utils import save_config, save_model

    hf = make_hf_model(name, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if name == "lfm2":  # mlx-lm's lfm2 requires what transformers 5 no longer writes
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "block_dim": config["hidden_size"],
                                                                 "block_ff_dim": config["intermediate_size"]}))
    theirs, their_config = mlx_lm_load_model(tmp_path / "hf")
    (tmp_path / "mlx_lm").mkdir()
    save_model(tmp_path / "mlx_lm", theirs)
    save_config(their_config, tmp_path / "mlx_lm" / "config.json")
    assert any(k.endswith("conv.conv.weight") for k, _ in tree_flatten(theirs.parameters()))
    ours, _ = load_model(tmp_path / "mlx_lm")
    np.testing.assert_allclose(np.array(ours(mx.array([PROMPT]))[0]), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
