"""The hybrid families (mlx_tfm/families/hybrids.py) on prompts longer than a chunk of the
delta rule: a 150-position prompt (three chunks of 64) against transformers (Qwen3.5's
image-text checkpoints on text: tests/generation/test_qwen3_5_image_generation.py runs their
images), and the on-disk layout mlx-lm's (folders we write
convert again unchanged, and mlx-lm reads them with our logits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import TINY_CONFIGS, greedy, hf_greedy, make_hf_model

from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

LONG_PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 256, size=150)]
QUIET = dict(log=lambda *_: None)


def logits_of(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def float64_logits(hf, ids) -> np.ndarray:
    """transformers' logits computed in float64: over 150 positions its own float32 run
    drifts about 1.5e-4 from them (as any float32 run of the chunked rule does), so the
    reference is the float64 one."""
    import torch

    hf.set_experts_implementation("eager")  # the grouped products have no float64
    with torch.no_grad():
        return hf.double()(torch.tensor([ids])).logits[0].numpy()


# The random Qwen3-Next model amplifies float32 rounding more than the others: reading the
# prompt position by position (our step form) lands 2e-4 from the float64 logits too.
LONG_PROMPT_ATOL = {"qwen3_next": 3e-4}


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_long_prompt_matches_transformers(name, tmp_path):
    hf = make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    assert model.args.linear_chunk_size < len(LONG_PROMPT)
    expected_greedy = hf_greedy(hf, LONG_PROMPT, 6)
    atol = LONG_PROMPT_ATOL.get(name, 1e-4)
    np.testing.assert_allclose(logits_of(model, LONG_PROMPT), float64_logits(hf, LONG_PROMPT), atol=atol, rtol=0)
    assert greedy(model, LONG_PROMPT, 6) == expected_greedy


def test_image_text_checkpoint_keeps_its_tower_beside_mlx_lms_language_model(tmp_path):
    """Qwen3.5's image-text checkpoint: the language model written in mlx-lm's names
    (``language_model.*``), the tower as transformers names it (``model.visual.*``, which
    mlx-lm's qwen3_5 drops on loading); the test above runs it on text."""
    make_hf_model("qwen3_5", tmp_path / "hf")
    source = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    tower = {name for name in source if name.startswith("model.visual.")}
    assert tower
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    written = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    assert {name for name in written if "visual" in name} == tower
    assert all(name.startswith("language_model.") for name in set(written) - tower)
    for name in tower:
        np.testing.assert_array_equal(np.array(written[name]), np.array(source[name]), err_msg=name)


def test_mlx_lms_folder_without_the_tower_loads_the_language_model_alone(tmp_path):
    """mlx-lm's conversion of the image-text checkpoint drops the tower and keeps
    vision_config: the language model alone, with the logits of the whole one on text."""
    from mlx_lm.convert import convert as mlx_lm_convert

    from mlx_tfm.model.transformer import Model
    from mlx_tfm.model.vision_language import VisionLanguageModel

    make_hf_model("qwen3_5", tmp_path / "hf")
    mlx_lm_convert(str(tmp_path / "hf"), str(tmp_path / "mlx-lm"))
    assert not any("visual" in name for name in mx.load(str(tmp_path / "mlx-lm" / "model.safetensors")))
    alone, _ = load_model(tmp_path / "mlx-lm")
    whole, _ = load_model(tmp_path / "hf")
    assert isinstance(alone, Model) and isinstance(whole, VisionLanguageModel)
    np.testing.assert_allclose(logits_of(alone, LONG_PROMPT[:20]), logits_of(whole, LONG_PROMPT[:20]), atol=1e-5,
                               rtol=0)


def test_on_disk_layout_is_mlx_lms(tmp_path):
    """Norms stored as (1 + weight), the convolution as MLX lays it out, Qwen3-Next's fused
    projections kept; a folder we wrote converts again to the same tensors."""
    make_hf_model("qwen3_next", tmp_path / "hf")
    source = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    written = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert source[conv].shape == (96, 1, 4) and written[conv].shape == (96, 4, 1)  # (conv_dim, ...)
    norm = "model.layers.0.input_layernorm.weight"
    np.testing.assert_allclose(np.array(written[norm]), np.array(source[norm]) + 1.0, atol=1e-6)
    gated_norm = "model.layers.0.linear_attn.norm.weight"  # a plain norm in transformers too
    np.testing.assert_array_equal(np.array(written[gated_norm]), np.array(source[gated_norm]))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in written
    convert(tmp_path / "mlx", tmp_path / "again", **QUIET)
    again = mx.load(str(tmp_path / "again" / "model.safetensors"))
    assert set(again) == set(written)
    for name in written:
        np.testing.assert_array_equal(np.array(again[name]), np.array(written[name]), err_msg=name)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_mlx_lm_reads_the_long_prompt_as_we_do(name, tmp_path):
    """mlx-lm runs the rule position by position, we chunk by chunk; both in float32, each
    within 1e-4 of the float64 values (the test above), so within 2e-4 of each other."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    ours, _ = load_model(tmp_path / "mlx")
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    np.testing.assert_allclose(logits_of(ours, LONG_PROMPT), logits_of(theirs, LONG_PROMPT), atol=2e-4, rtol=0)


def test_layer_types_from_full_attention_interval_as_transformers_derives_them():
    """Hub configs may give only ``full_attention_interval``: the layer types are what
    transformers derives from it."""
    from transformers import AutoConfig

    from mlx_tfm.families import model_args_from_config

    keys = {**TINY_CONFIGS["qwen3_next"], "num_hidden_layers": 6, "full_attention_interval": 3}
    theirs = AutoConfig.for_model("qwen3_next", **keys).layer_types
    ours = model_args_from_config({**keys, "model_type": "qwen3_next"}).layer_types
    assert list(ours) == list(theirs) and ours.count("full_attention") == 2


def test_image_text_checkpoint_ties_embeddings_by_its_outer_config():
    """transformers ties an image-text model's head by the outer config's flag."""
    from mlx_tfm.families import model_args_from_config

    text = {**TINY_CONFIGS["qwen3_5_text"], "tie_word_embeddings": False}
    tied = model_args_from_config({"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text})
    untied = model_args_from_config({"model_type": "qwen3_5", "text_config": text})
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings
