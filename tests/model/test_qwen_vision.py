"""Qwen2-VL's and Qwen2.5-VL's vision towers against transformers', piece by piece."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.qwen_vision_models import GRIDS, hf_vision_tower, random_pixel_values
from mlx.utils import tree_flatten, tree_unflatten
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from mlx_tfm.errors import UserError
from mlx_tfm.model.qwen_vision import QwenVisionArgs, QwenVisionTower, patch_layout, segment_batch, window_plan


def our_tower(hf_tower, config, style: str) -> QwenVisionTower:
    """Our tower with transformers' weights: the Conv3d kernel (D, C, T, P, P) flattened
    to the matmul's (D, C * T * P * P), every other tensor as it is."""
    tower = QwenVisionTower(QwenVisionArgs.from_dict(config.to_dict(), style))
    weights = {name: mx.array(value.numpy()) for name, value in hf_tower.state_dict().items()}
    weights["patch_embed.proj.weight"] = weights["patch_embed.proj.weight"].reshape(tower.args.hidden_size, -1)
    tower.update(tree_unflatten(list(weights.items())))
    assert sorted(weights) == sorted(name for name, _ in tree_flatten(tower.parameters()))  # every tensor used
    return tower


@pytest.mark.parametrize("style", ["qwen2_vl", "qwen2_5_vl"])
def test_tower_matches_transformers_on_two_images_of_different_grids(style):
    hf_tower, config = hf_vision_tower(style)
    pixel_values = random_pixel_values(GRIDS, config)
    with torch.no_grad():
        expected = hf_tower(torch.from_numpy(pixel_values), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
    ours = our_tower(hf_tower, config, style)(mx.array(pixel_values), GRIDS)
    assert ours.shape == expected.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 48)
    assert np.abs(expected).mean() > 0.3  # O(1) outputs, so 1e-4 means something
    np.testing.assert_allclose(np.array(ours), expected, atol=1e-4, rtol=1e-4)


def test_each_image_is_encoded_alone():
    """Attention stays inside an image: two images in one call == each image alone."""
    hf_tower, config = hf_vision_tower("qwen2_5_vl")
    tower = our_tower(hf_tower, config, "qwen2_5_vl")
    pixel_values = random_pixel_values(GRIDS, config)
    together = np.array(tower(mx.array(pixel_values), GRIDS))
    first = GRIDS[0][1] * GRIDS[0][2]
    alone = [np.array(tower(mx.array(pixel_values[:first]), GRIDS[:1])),
             np.array(tower(mx.array(pixel_values[first:]), GRIDS[1:]))]
    np.testing.assert_allclose(together, np.concatenate(alone), atol=1e-5, rtol=1e-5)


def test_positions_and_windows_match_transformers():
    grids = torch.tensor(GRIDS + [[2, 4, 6]])  # a two-frame clip too
    args = QwenVisionArgs(style="qwen2_5_vl", patch_size=2, window_size=8, spatial_merge_size=2)
    layout = patch_layout(grids.numpy(), args)
    window_index, cu_window = get_vision_window_index(grids, spatial_merge_size=2, window_size=8, patch_size=2)
    np.testing.assert_array_equal(layout.window_order, window_index.numpy())
    positions = get_vision_position_ids(grids, 2).numpy()  # (N, 2) in pixel_values' order
    unit_order = (window_index.numpy()[:, None] * 4 + np.arange(4)).reshape(-1)
    np.testing.assert_array_equal(layout.positions, positions[unit_order])
    # the windows as transformers' cumulative lengths: each window's start, in patches
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], layout.window_segments])))
    np.testing.assert_array_equal(np.append(starts, len(layout.window_segments)), cu_window.numpy())


def test_window_plan_of_one_image_by_hand():
    """A 3x3 grid of merged patches in 2x2 windows: [[0, 1 | 2], [3, 4 | 5], [6, 7 | 8]]."""
    order, windows = window_plan(np.array([[1, 6, 6]]), merge_size=2, window=2)
    assert order.tolist() == [0, 1, 3, 4, 2, 5, 6, 7, 8]
    assert windows.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3]


def test_segments_become_a_padded_batch():
    """Runs of 3, 1 and 2 patches: a (3, 3) batch, the short rows padded and masked."""
    batch = segment_batch(np.array([0, 0, 0, 1, 2, 2]))
    assert np.array(batch.gather).tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert np.array(batch.key_mask)[:, 0, 0].tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    assert np.array(batch.scatter).tolist() == [0, 1, 2, 3, 6, 7]
    assert segment_batch(np.array([0, 0, 1, 1])).key_mask is None  # equal runs need no mask


def test_bad_grids_are_one_line_errors():
    args = QwenVisionArgs(style="qwen2_vl", depth=1, hidden_size=8, num_heads=2, intermediate_size=8,
                          out_hidden_size=8, hidden_act="quick_gelu", patch_size=2)
    tower = QwenVisionTower(args)
    with pytest.raises(UserError, match="not multiples of the merge size 2"):
        tower(mx.zeros((15, 24)), [[1, 3, 5]])
    with pytest.raises(UserError, match="10 patches for image grids of 16"):
        tower(mx.zeros((10, 24)), [[1, 4, 4]])
    with pytest.raises(UserError, match="unknown Qwen vision tower 'qwen9'"):
        QwenVisionArgs.from_dict({}, "qwen9")
