"""Gemma 4 with its vision tower (model/gemma4_vision.py, families/gemma4_vision.py)
against transformers 5 on a tiny random model: image features, logits and greedy tokens of
the whole Gemma4ForConditionalGeneration for two images of different grids (the per-layer
inputs of the image tokens are the pad token's), and our cached decoding against our own
full forward."""

import mlx.core as mx
import numpy as np
import pytest
from fixtures.gemma4_vision_models import GRIDS, IMAGE_TOKEN, cut_patches, make_gemma4_model

from mlx_tfm.loading import load_model


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4")
    hf = make_gemma4_model(folder)
    model, _ = load_model(folder)
    return hf, model, folder


def torch_inputs(inputs: dict) -> dict:
    import torch

    return {name: torch.tensor(value) for name, value in inputs.items()}


def our_features(model, inputs: dict) -> mx.array:
    return model.encode_images(mx.array(inputs["pixel_values"]), inputs["image_position_ids"])


def prompt_ids() -> list[int]:
    ids = [2, 7]
    for rows, cols in GRIDS:
        ids += [251] + [IMAGE_TOKEN] * ((rows // 2) * (cols // 2)) + [252, 9]
    return ids + [12, 13, 40, 41]  # past the sliding window (6)


def test_image_features_match_transformers(gemma4):
    import torch

    hf, model, _ = gemma4
    inputs = cut_patches()
    with torch.no_grad():
        expected = hf.model.get_image_features(**torch_inputs(inputs)).pooler_output
    assert [len(f) for f in expected] == [6, 2]
    np.testing.assert_allclose(np.array(our_features(model, inputs)), torch.cat(expected).numpy(), atol=1e-4, rtol=0)


def test_logits_and_greedy_tokens_match_transformers(gemma4):
    import torch

    hf, model, _ = gemma4
    inputs, ids = cut_patches(), prompt_ids()
    features = our_features(model, inputs)
    hf_inputs = {"input_ids": torch.tensor([ids]), **torch_inputs(inputs)}
    with torch.no_grad():
        expected = hf(**hf_inputs).logits[0].numpy()
        hf_tokens = hf.generate(**hf_inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
    np.testing.assert_allclose(np.array(model(mx.array([ids]), image_features=features)[0]), expected, atol=1e-4,
                               rtol=0)
    cache, tokens = model.make_cache(), []
    logits = model(mx.array([ids]), cache=cache, image_features=features)
    for _ in range(6):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
    assert tokens == hf_tokens


def test_cached_decoding_equals_the_full_forward(gemma4):
    _, model, _ = gemma4
    features = our_features(model, cut_patches())
    ids, continuation = prompt_ids(), [7, 200, 42, 11]
    full = np.array(model(mx.array([ids + continuation]), image_features=features)[0])
    cache = model.make_cache()
    steps = [np.array(model(mx.array([ids]), cache=cache, image_features=features)[0])]
    steps += [np.array(model(mx.array([[t]]), cache=cache)[0]) for t in continuation]
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-4, rtol=0)
