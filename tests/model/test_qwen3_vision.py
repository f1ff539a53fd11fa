"""Qwen3-VL pieces against transformers: the tower (learned positions resampled to each
grid, DeepStack features), the interleaved M-RoPE, the whole model's logits (dense and
MoE, both expert orientations); Qwen3.5's tower and partial M-RoPE."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.convert_helpers import TINY_CONFIGS
from fixtures.qwen_vision_models import GRIDS, IMAGE_TOKEN, hf_qwen3_vl_model, image_prompt, perturb, random_pixel_values
from mlx.utils import tree_unflatten

from mlx_tfm.errors import UserError
from mlx_tfm.families.qwen_vl import vision_tower_from_checkpoint
from mlx_tfm.loading import load_model
from mlx_tfm.model.mrope import MRoPE, frequency_axes
from mlx_tfm.model.positions import RoPE
from mlx_tfm.model.qwen3_vision import Qwen3VisionTower, axis_taps, split_deepstack
from mlx_tfm.model.qwen_vision import QwenVisionArgs
from mlx_tfm.weights.files import read_checkpoint, save_weights

PROMPT = image_prompt(GRIDS, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])


def hf_weights(hf_model) -> dict:
    return {k: mx.array(v.numpy()) for k, v in hf_model.state_dict().items()}


def test_the_tower_matches_transformers_image_and_deepstack_features():
    hf_model = hf_qwen3_vl_model()
    pixel_values = random_pixel_values(GRIDS, hf_model.config.vision_config)
    with torch.no_grad():
        out = hf_model.model.get_image_features(torch.from_numpy(pixel_values), torch.tensor(GRIDS))
    expected = [torch.cat(out.pooler_output).numpy()] + [torch.cat(f).numpy() for f in out.deepstack_features]
    tower = vision_tower_from_checkpoint(hf_model.config.to_dict(), hf_weights(hf_model))
    features, deepstack = split_deepstack(tower(mx.array(pixel_values), GRIDS), 2)
    for ours, theirs in zip([features, *deepstack], expected):
        np.testing.assert_allclose(np.array(ours), theirs, atol=1e-4, rtol=1e-4)
    assert np.abs(expected[1] - expected[2]).max() > 1e-2  # the two DeepStack features differ


def test_resampled_positions_are_bilinear_with_aligned_corners():
    """A 3-long table read at 5 positions: 0, 0.5, 1, 1.5, 2 of the table (ends on ends)."""
    taps, weights = axis_taps(np.arange(5.0), np.full(5, 5), 3)
    mixed = (np.array([10.0, 20.0, 40.0])[taps] * weights).sum(axis=1)
    np.testing.assert_allclose(mixed, [10, 15, 20, 30, 40])
    single, _ = axis_taps(np.zeros(1), np.ones(1), 3)  # a one-patch side reads the first row
    assert single[0].tolist() == [0, 1]


def test_interleaved_frequencies_match_transformers_rotary():
    """The axis of each frequency, read off transformers' Qwen3-VL text rotary: positions
    that differ only on one axis change only that axis's frequencies."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = hf_qwen3_vl_model().config.text_config
    rotary = Qwen3VLTextRotaryEmbedding(config)
    base = torch.zeros(3, 1, 1, dtype=torch.long)
    _, sin0 = rotary(torch.zeros(1), base)
    expected = np.zeros(8, dtype=np.int64)
    for axis in (1, 2):
        moved = base.clone()
        moved[axis] = 7
        _, sin = rotary(torch.zeros(1), moved)
        expected[(sin - sin0)[0, 0, :8].abs().numpy() > 1e-6] = axis
    np.testing.assert_array_equal(frequency_axes((4, 2, 2), interleaved=True), expected)
    assert frequency_axes((4, 2, 2)).tolist() == [0, 0, 0, 0, 1, 1, 2, 2]  # Qwen2-VL's runs differ
    rope = MRoPE(16, 10000.0, (4, 2, 2), 512, interleaved=True)
    assert rope.interleaved and not MRoPE(16, 10000.0, (4, 2, 2), 512).interleaved


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_vl", "qwen3_vl_moe"])
def test_the_loaded_model_matches_transformers_with_deepstack(moe, tmp_path):
    hf_model = hf_qwen3_vl_model(seed=1, moe=moe)
    hf_model.save_pretrained(tmp_path)
    pixel_values = random_pixel_values(GRIDS, hf_model.config.vision_config, seed=1)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = hf_model(input_ids=ids, pixel_values=torch.from_numpy(pixel_values),
                            image_grid_thw=torch.tensor(GRIDS), mm_token_type_ids=(ids == IMAGE_TOKEN).int()
                            ).logits[0].numpy()
    model, _ = load_model(tmp_path)
    features = model.encode_images(mx.array(pixel_values), grid_thw=GRIDS)
    positions, _ = model.rope_positions(PROMPT, GRIDS)
    ours = np.array(model(mx.array([PROMPT]), image_features=features, positions=positions)[0])
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-4)
    without = features.reshape(features.shape[0], 3, -1)[:, :1].reshape(features.shape[0], -1)
    assert np.abs(np.array(model.deepstack_forward(
        model.embed_tokens(mx.array([PROMPT]), mx.array([PROMPT]) == IMAGE_TOKEN), mx.array([PROMPT]) == IMAGE_TOKEN,
        [mx.zeros_like(without)] * 2, None, None, positions))[0] - expected).max() > 1e-2  # DeepStack matters


def test_a_position_table_that_is_not_square_is_one_line():
    args = QwenVisionArgs(style="qwen3_vl", depth=1, hidden_size=8, num_heads=2, intermediate_size=8,
                          out_hidden_size=8, hidden_act="gelu_tanh", patch_size=2, num_position_embeddings=15)
    with pytest.raises(UserError, match="num_position_embeddings 15 is not a square grid"):
        Qwen3VisionTower(args)
    tower = Qwen3VisionTower(QwenVisionArgs(**{**args.__dict__, "num_position_embeddings": 16}))
    tower.update(tree_unflatten([]))
    with pytest.raises(UserError, match="3 patches for image grids of 4"):
        tower(mx.zeros((3, 24)), [[1, 2, 2]])


def test_the_hubs_expert_orientation_loads_the_same(tmp_path):
    """Qwen3-VL-MoE's hub checkpoints hold gate_up_proj (E, D, 2F) and down_proj (E, F, D),
    transposed from what transformers 5 saves; here 2F = D, so only down_proj tells them apart."""
    hf_model = hf_qwen3_vl_model(moe=True)
    hf_model.save_pretrained(tmp_path / "saved")
    config, weights = read_checkpoint(tmp_path / "saved")
    hub = {k: v.swapaxes(1, 2) if ".experts." in k else v for k, v in weights.items()}
    assert hub["model.language_model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 64)
    (tmp_path / "hub").mkdir()
    save_weights(tmp_path / "hub", hub)
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    ids = mx.array([PROMPT[:8]])
    saved, from_hub = load_model(tmp_path / "saved")[0], load_model(tmp_path / "hub")[0]
    np.testing.assert_array_equal(np.array(saved(ids)), np.array(from_hub(ids)))


def test_a_partial_mrope_turns_only_the_first_dims():
    """Qwen3.5 rotates a quarter of each head: on text positions (t = h = w) that is the
    plain partial rotary, and the other dims pass unchanged."""
    x = mx.random.normal((1, 2, 5, 16))
    positions = mx.broadcast_to(mx.arange(3, 8)[None, None], (3, 1, 5))
    rope = MRoPE(4, 10000.0, (1, 1, 0), 512, interleaved=True)
    np.testing.assert_allclose(np.array(rope(x, positions)), np.array(RoPE(4, False, 10000.0, None, 512)(x, 3)),
                               atol=1e-5)
    np.testing.assert_array_equal(np.array(rope(x, positions))[..., 4:], np.array(x)[..., 4:])


def test_qwen3_5s_tower_is_qwen3_vls_without_deepstack():
    """transformers' Qwen3.5 image features from our Qwen3-VL tower (no DeepStack mergers)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    keys = dict(TINY_CONFIGS["qwen3_5"])
    keys["vision_config"] = {**keys["vision_config"], "patch_size": 2, "num_position_embeddings": 16}
    hf_model = perturb(AutoModelForImageTextToText.from_config(AutoConfig.for_model("qwen3_5", **keys),
                                                               attn_implementation="eager"))
    pixel_values = random_pixel_values(GRIDS, hf_model.config.vision_config)
    with torch.no_grad():
        expected = torch.cat(hf_model.model.get_image_features(torch.from_numpy(pixel_values), torch.tensor(GRIDS))
                             .pooler_output).numpy()
    tower = vision_tower_from_checkpoint(hf_model.config.to_dict(), hf_weights(hf_model))
    assert isinstance(tower, Qwen3VisionTower) and not tower.deepstack_merger_list
    np.testing.assert_allclose(np.array(tower(mx.array(pixel_values), GRIDS)), expected, atol=1e-4, rtol=1e-4)
