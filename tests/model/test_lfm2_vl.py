"""LFM2-VL (model/lfm2_vl_vision.py, families/lfm2_vl.py) against transformers 5 on a tiny
random model: image features, logits and greedy tokens of the whole
Lfm2VlForConditionalGeneration for two images of different patch grids, our cached decoding
against our own full forward, and the position table's resize against torch's antialiased
bilinear interpolation. Its preprocessing and generation with images:
tests/tokenizer/test_lfm2_vl_images.py, tests/generation/test_lfm2_vl_generation.py."""

import mlx.core as mx
import numpy as np
import pytest
from fixtures.image_decoding import cached_and_full_logits, greedy_with_images
from fixtures.lfm2_vl_models import GRIDS, IMAGE_TOKEN, cut_patches, make_lfm2_vl_model

from mlx_tfm.loading import load_model
from mlx_tfm.model.lfm2_vl_vision import resize_weights, unshuffle_patches


@pytest.fixture(scope="module")
def lfm2_vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lfm2_vl")
    hf = make_lfm2_vl_model(folder)
    model, _ = load_model(folder)
    return hf, model, folder


def torch_inputs(inputs: dict) -> dict:
    import torch

    return {name: torch.tensor(value) for name, value in inputs.items()}


def our_features(model, inputs: dict) -> mx.array:
    return model.encode_images(mx.array(inputs["pixel_values"]), inputs["spatial_shapes"])


def prompt_ids() -> list[int]:
    ids = [1, 7]
    for rows, cols in GRIDS:
        ids += [IMAGE_TOKEN] * ((rows // 2) * (cols // 2)) + [9, 11]
    return ids + [12, 13]


def test_image_features_match_transformers(lfm2_vl):
    import torch

    hf, model, _ = lfm2_vl
    inputs = cut_patches()
    with torch.no_grad():
        expected = hf.model.get_image_features(**torch_inputs(inputs)).pooler_output
    assert [len(f) for f in expected] == [12, 4]
    np.testing.assert_allclose(np.array(our_features(model, inputs)), torch.cat(expected).numpy(), atol=1e-4, rtol=0)


def test_logits_and_greedy_tokens_match_transformers(lfm2_vl):
    import torch

    hf, model, _ = lfm2_vl
    inputs, ids = cut_patches(), prompt_ids()
    features = our_features(model, inputs)
    hf_inputs = {"input_ids": torch.tensor([ids]), **torch_inputs(inputs)}
    with torch.no_grad():
        expected = hf(**hf_inputs).logits[0].numpy()
        hf_tokens = hf.generate(**hf_inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
    np.testing.assert_allclose(np.array(model(mx.array([ids]), image_features=features)[0]), expected, atol=1e-4,
                               rtol=0)
    assert greedy_with_images(model, ids, features, 6) == hf_tokens


def test_cached_decoding_equals_the_full_forward(lfm2_vl):
    _, model, _ = lfm2_vl
    features = our_features(model, cut_patches())
    ids, continuation = prompt_ids(), [7, 200, 42, 11]
    cached, full = cached_and_full_logits(model, ids, features, continuation)
    np.testing.assert_allclose(cached, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("out_size", [2, 3, 4, 7, 16])
def test_the_position_resize_is_torchs_antialiased_bilinear(out_size):
    import torch

    table = np.random.default_rng(1).normal(size=(1, 1, 4, 5)).astype(np.float32)  # a 4 x 5 grid, one channel
    expected = torch.nn.functional.interpolate(torch.tensor(table), size=(out_size, 3), mode="bilinear",
                                               align_corners=False, antialias=True)[0, 0].numpy()
    ours = np.array(resize_weights(out_size, 4)) @ table[0, 0] @ np.array(resize_weights(3, 5)).T
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)


def test_unshuffle_orders_each_block_row_offset_column_offset_channel():
    states = mx.arange(4 * 6 * 2).reshape(24, 2)  # a 4 x 6 grid of width 2: patch (r, c) holds 12r + 2c + [0, 1]
    block = np.array(unshuffle_patches(states, 4, 6, 2))[4]  # second block row, second block column
    patch = lambda r, c: [12 * r + 2 * c, 12 * r + 2 * c + 1]
    assert block.tolist() == patch(2, 2) + patch(2, 3) + patch(3, 2) + patch(3, 3)


def test_convert_q_keeps_the_tower_in_float_and_its_features(lfm2_vl, tmp_path):
    from mlx_tfm.convert.converter import convert

    _, model, folder = lfm2_vl
    convert(folder, tmp_path / "q4", quantize=True, q_group_size=32, log=lambda *_: None)
    weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    vision = [n for n in weights if n.startswith(("vision_tower.", "multi_modal_projector."))]
    assert vision and not [n for n in vision if n.endswith(".scales")]
    assert weights["language_model.model.layers.1.self_attn.q_proj.weight"].dtype == mx.uint32
    quantized, _ = load_model(tmp_path / "q4")
    inputs = cut_patches()
    np.testing.assert_allclose(np.array(our_features(quantized, inputs)), np.array(our_features(model, inputs)),
                               atol=1e-5, rtol=0)

