"""Vision-language models (model/vision_language.py) against transformers'
*ForConditionalGeneration on tiny random models with the two test images: logits, greedy
tokens, and our cached decoding after the prompt against our own full forward."""

import mlx.core as mx
import numpy as np
import pytest
from fixtures.vision_images import two_images
from fixtures.vision_models import (
    IMAGE_TOKEN,
    PROCESSOR_KIND,
    VISION_CONFIGS,
    hf_pixel_values,
    make_vision_model,
)
from fixtures.vision_processors import image_processor

from mlx_tfm.loading import load_model
from mlx_tfm.model.vision_language import image_blocks
from mlx_tfm.tokenizer.images import preprocess_images, read_image_processing


def prompt_and_pixels(family: str, model) -> tuple[list[int], np.ndarray, mx.array]:
    """Text tokens around each image's run of image tokens, the pixel values, our features."""
    processing = read_image_processing(image_processor(PROCESSOR_KIND[family]).to_dict())
    pixels = preprocess_images(two_images(), processing)["pixel_values"]
    features = model.encode_images(mx.array(pixels))
    per_image = features.shape[0] // 2
    ids = [5, 17] + [IMAGE_TOKEN] * per_image + [33, 9] + [IMAGE_TOKEN] * per_image + [101, 64, 3]
    return ids, pixels, features


def hf_inputs(family: str, ids: list[int], pixels: np.ndarray) -> dict:
    import torch

    inputs = {"input_ids": torch.tensor([ids]), "pixel_values": hf_pixel_values(family, pixels)}
    if family == "gemma3":  # marks the image tokens, which attend to each other both ways
        inputs["token_type_ids"] = (inputs["input_ids"] == IMAGE_TOKEN).long()
    return inputs


@pytest.mark.parametrize("family", sorted(VISION_CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(family, tmp_path):
    import torch

    hf = make_vision_model(family, tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    ids, pixels, features = prompt_and_pixels(family, model)
    with torch.no_grad():
        expected = hf(**hf_inputs(family, ids, pixels)).logits[0].float().numpy()
        hf_tokens = hf.generate(**hf_inputs(family, ids, pixels), max_new_tokens=6, do_sample=False,
                                min_new_tokens=6, pad_token_id=0)[0, len(ids):].tolist()
    ours = np.array(model(mx.array([ids]), image_features=features)[0])
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    assert greedy_with_images(model, ids, features, 6) == hf_tokens


def greedy_with_images(model, ids: list[int], features: mx.array, n: int) -> list[int]:
    """The prompt (its image features in place) into the KV cache, then text decoding."""
    cache = model.make_cache()
    logits = model(mx.array([ids]), cache=cache, image_features=features)
    tokens = []
    for _ in range(n):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
    return tokens


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_cached_decoding_equals_the_full_forward(family, tmp_path):
    make_vision_model(family, tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    ids, _, features = prompt_and_pixels(family, model)
    continuation = [7, 200, 42, 11]
    full = np.array(model(mx.array([ids + continuation]), image_features=features)[0])
    cache = model.make_cache()
    steps = [np.array(model(mx.array([ids]), cache=cache, image_features=features)[0])]
    steps += [np.array(model(mx.array([[t]]), cache=cache)[0]) for t in continuation]
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-4, rtol=0)


def test_gemma3_image_tokens_attend_both_ways(tmp_path):
    """An image token's output depends on the image tokens after it (not so for text)."""
    make_vision_model("gemma3", tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    ids, _, features = prompt_and_pixels("gemma3", model)
    first_image = ids.index(IMAGE_TOKEN)
    changed = mx.concatenate([features[:1], features[1:] * 0.5])
    before = np.array(model(mx.array([ids]), image_features=features)[0, first_image])
    after = np.array(model(mx.array([ids]), image_features=changed)[0, first_image])
    assert np.abs(before - after).max() > 1e-3


def test_image_blocks_number_each_run_of_image_tokens():
    is_image = mx.array([[False, True, True, False, True, False]])
    assert image_blocks(is_image).tolist() == [[-1, 0, 0, -1, 1, -1]]


def test_too_few_image_tokens_for_the_features_is_an_error(tmp_path):
    make_vision_model("llava", tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    ids, _, features = prompt_and_pixels("llava", model)
    with pytest.raises(ValueError, match="image tokens for 32 image features"):
        model(mx.array([ids[:-20]]), image_features=features)
