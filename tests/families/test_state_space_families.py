"""The state-space families (mlx_tfm/families/state_space.py) against transformers on
prompts longer than several SSD chunks, in the variants TINY_CONFIGS leaves out: grouped
gated norms, time-step limits, dense Granite 4, Falcon-H1 without its gated norm or with a
tied head; cached decoding through hybrid layers; and the options refused."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import hf_logits, make_hf_model

from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.loading import load_model

LONG_PROMPT = [(7 * i + 3) % 256 for i in range(41)]  # ten chunks of 4, and one position more
QUIET = dict(log=lambda *_: None)


def our_logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


# name -> config overrides: chunks of 4; n_groups 2 where TINY_CONFIGS keeps 1 for mlx-lm
VARIANTS = {
    "mamba2_groups_and_limits": ("mamba2", dict(chunk_size=4, n_groups=2, time_step_limit=(0.05, 0.4))),
    "nemotron_h": ("nemotron_h", dict(chunk_size=4)),
    "granitemoehybrid_groups": ("granitemoehybrid", dict(mamba_chunk_size=4, mamba_n_groups=2,
                                                         time_step_limit=(0.05, 0.4))),
    "granitemoehybrid_dense": ("granitemoehybrid", dict(mamba_chunk_size=4, num_local_experts=0)),
    "falcon_h1_groups": ("falcon_h1", dict(mamba_chunk_size=4, mamba_n_groups=2, time_step_limit=(0.05, 0.4))),
    "falcon_h1_norm_after_gate": ("falcon_h1", dict(mamba_chunk_size=4, mamba_norm_before_gate=False)),
    "falcon_h1_no_gated_norm": ("falcon_h1", dict(mamba_chunk_size=4, mamba_rms_norm=False)),
    "falcon_h1_tied": ("falcon_h1", dict(mamba_chunk_size=4, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prompt_over_many_chunks_matches_transformers(variant, tmp_path):
    name, overrides = VARIANTS[variant]
    hf = make_hf_model(name, tmp_path / "hf", **overrides)
    model, _ = load_model(tmp_path / "hf")
    np.testing.assert_allclose(our_logits(model, LONG_PROMPT), hf_logits(hf, LONG_PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["falcon_h1", "granitemoehybrid", "nemotron_h"])
def test_cached_decoding_equals_a_full_forward(name, tmp_path):
    """Prefill in two pieces, then a token at a time, through every kind of layer each hybrid
    has (Falcon-H1's through its ParallelCache), equals the full forward."""
    make_hf_model(name, tmp_path / "hf", **({"chunk_size": 4} if name == "nemotron_h" else {"mamba_chunk_size": 4}))
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    ids = mx.array([LONG_PROMPT[:24]])
    cache = model.make_cache()
    pieces = [model(ids[:, :9], cache=cache), model(ids[:, 9:15], cache=cache)]
    pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(15, 24)]
    np.testing.assert_allclose(np.array(mx.concatenate(pieces, axis=1)), np.array(model(ids)), atol=1e-4, rtol=0)
    assert all(c.offset == 24 for c in cache)


@pytest.mark.parametrize("name,overrides", [
    ("granitemoehybrid", dict(num_local_experts=0)),  # the shared MLP alone: mlx-lm's dense mlp.* layout
    ("mamba2", dict(chunk_size=4)),  # ten of our chunks; mlx-lm scans in its own
    ("falcon_h1", dict(mamba_chunk_size=4)),
], ids=["granite_dense", "mamba2", "falcon_h1"])
def test_long_prompts_and_dense_granite_in_mlx_lm(name, overrides, tmp_path):
    from mlx_lm.utils import load_model as mlx_lm_load_model

    make_hf_model(name, tmp_path / "hf", **overrides)
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    ours, _ = load_model(tmp_path / "mlx")
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(ours, LONG_PROMPT), our_logits(theirs, LONG_PROMPT), atol=1e-4, rtol=0)


def test_falcon_h1_folder_holds_folded_multipliers(tmp_path):
    """The converted folder is mlx-lm's layout: multipliers in the weights, conv in MLX's
    layout; converting it again leaves it as it is (nothing is folded twice)."""
    make_hf_model("falcon_h1", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    convert(tmp_path / "mlx", tmp_path / "again", **QUIET)
    source = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    once, twice = mx.load(str(tmp_path / "mlx" / "model.safetensors")), mx.load(str(tmp_path / "again" / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    np.testing.assert_allclose(np.array(once[name]), np.array(source[name]) * 1.3 * 0.7, rtol=1e-6)  # in x key
    assert once["model.layers.0.mamba.conv1d.weight"].shape == (80, 4, 1)  # (conv_dim, K, 1)
    for key in once:
        np.testing.assert_array_equal(np.array(twice[key]), np.array(once[key]))


def hf_config(name: str, tmp_path, **overrides) -> dict:
    make_hf_model(name, tmp_path, **overrides)
    return json.loads((tmp_path / "config.json").read_text())


def test_nemotron_h_layer_kinds_read_from_either_spelling(tmp_path):
    config = hf_config("nemotron_h", tmp_path)
    legacy = {k: v for k, v in config.items() if k != "layers_block_type"}
    legacy["hybrid_override_pattern"] = "M-*-M"
    ours = model_args_from_config(config)
    assert ours == model_args_from_config(legacy)
    assert ours.layer_types == ("mamba", "full_attention", "full_attention", "full_attention", "mamba")
    assert ours.block_sublayers == ("mixer", "mlp", "mixer", "mlp", "mixer")


def test_unsupported_options_are_one_line_errors():
    with pytest.raises(UserError, match="nemotron_h layers of kind 'E' are not supported"):
        model_args_from_config({"model_type": "nemotron_h", "hybrid_override_pattern": "ME", "hidden_size": 32,
                                "vocab_size": 256, "num_attention_heads": 4, "intermediate_size": 64,
                                "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8})
    with pytest.raises(UserError, match=r"the Mamba heads \(4 x 8\) do not tile the inner width 64"):
        model_args_from_config({"model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 256,
                                "num_heads": 4, "head_dim": 8, "state_size": 8})
    with pytest.raises(UserError, match="mamba2 with hidden_act 'gelu' is not supported"):
        model_args_from_config({"model_type": "mamba2", "hidden_act": "gelu"})
