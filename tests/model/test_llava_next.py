"""LLaVA-NeXT (``llava_next``: LLaVA's tower and projector over anyres views, packed by
model/anyres.py) against transformers' LlavaNextForConditionalGeneration on a tiny random
model with the two test images, which fit different grids: the packed image features,
the logits, greedy tokens, and cached decoding against our own full forward."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from fixtures.image_decoding import greedy_with_images
from fixtures.vision_images import two_images
from fixtures.vision_models import IMAGE_TOKEN, make_vision_model
from fixtures.vision_processors import image_processor

from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.jsonfile import read_json
from mlx_tfm.loading import load_model
from mlx_tfm.tokenizer.image_tokens import image_token_count, read_image_prompt
from mlx_tfm.tokenizer.images import read_image_processing
from mlx_tfm.tokenizer.llava_next_images import preprocess_llava_next_images


# processor_config.json as the hub's LLaVA-NeXT folders write it (the class token counted, then dropped)
LLAVA_NEXT_PROCESSOR = {"patch_size": 8, "num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava_next") / "hf"
    hf = make_vision_model("llava_next", folder)
    model, _ = load_model(folder)
    return hf, model, folder


def our_inputs(model, folder):
    """Our preprocessed images, their features, and a prompt with text around each image."""
    processing = dataclasses.replace(read_image_processing(image_processor("llava_next").to_dict()), patch_size=8)
    images = preprocess_llava_next_images(two_images(), processing)
    features = model.encode_images(mx.array(images["pixel_values"]), image_sizes=images["image_sizes"])
    prompt = read_image_prompt("llava_next", LLAVA_NEXT_PROCESSOR, read_json(folder / "config.json"))
    first, second = (image_token_count(prompt, r, c) for r, c in zip(images["rows"], images["cols"]))
    ids = [5, 17] + [IMAGE_TOKEN] * first + [33, 9] + [IMAGE_TOKEN] * second + [101, 64, 3]
    return images, features, ids


def hf_inputs(ids, images) -> dict:
    """transformers' inputs: each image's views as one batch row (zero views after the
    fewer, as its processor pads them), each image's size once."""
    import torch

    views = images["views"]
    starts = np.cumsum([0, *views])[:-1]
    rows = [np.pad(images["pixel_values"][a:a + n], ((0, max(views) - n), (0, 0), (0, 0), (0, 0)))
            for a, n in zip(starts, views)]
    return {"input_ids": torch.tensor([ids]), "pixel_values": torch.tensor(np.stack(rows)),
            "image_sizes": torch.tensor(images["image_sizes"][starts])}


def test_packed_image_features_match_transformers(models):
    import torch

    hf, model, folder = models
    images, features, _ = our_inputs(model, folder)
    inputs = hf_inputs([0], images)
    with torch.no_grad():
        theirs = hf.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
    expected = torch.cat(list(theirs)).numpy()
    assert features.shape == expected.shape == ((16 + 4 * 7) + (16 + 8 * 5), 64)
    np.testing.assert_allclose(np.array(features), expected, atol=1e-4, rtol=0)


def test_logits_and_greedy_tokens_match_transformers(models):
    import torch

    hf, model, folder = models
    images, features, ids = our_inputs(model, folder)
    with torch.no_grad():
        expected = hf(**hf_inputs(ids, images)).logits[0].float().numpy()
        hf_tokens = hf.generate(**hf_inputs(ids, images), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                pad_token_id=0)[0, len(ids):].tolist()
    ours = np.array(model(mx.array([ids]), image_features=features)[0])
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    assert greedy_with_images(model, ids, features, 6) == hf_tokens


def test_cached_decoding_in_chunks_equals_the_full_forward(models):
    """The prompt in two chunks cut inside the first image's tokens, then token by token."""
    _, model, folder = models
    _, features, ids = our_inputs(model, folder)
    continuation, cut = [7, 200, 42, 11], 30
    full = np.array(model(mx.array([ids + continuation]), image_features=features)[0])
    cache, before = model.make_cache(), ids[:cut].count(IMAGE_TOKEN)
    steps = [np.array(model(mx.array([ids[:cut]]), cache=cache, image_features=features[:before])[0]),
             np.array(model(mx.array([ids[cut:]]), cache=cache, image_features=features[before:])[0])]
    steps += [np.array(model(mx.array([[t]]), cache=cache)[0]) for t in continuation]
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-4, rtol=0)


def test_the_full_feature_strategy_is_one_line(models):
    _, _, folder = models
    config = {**read_json(folder / "config.json"), "vision_feature_select_strategy": "full"}
    with pytest.raises(UserError, match="'full' keeps CLIP's class token") as error:
        model_args_from_config(config)
    assert "\n" not in str(error.value)


def test_packed_features_at_the_hubs_geometry_match_transformers(tmp_path):
    """The hub's geometry (336-pixel views of 14-pixel patches, transformers' default
    resolutions) with a narrow random tower: a photo-shaped image (2 x 2 views, unpadded
    rows) and a tall one (3 x 1) give transformers' packed features."""
    import torch
    import transformers
    from fixtures.vision_images import drawn_image
    from fixtures.vision_models import VISION_CONFIGS

    from mlx_tfm.families.vision import LLAVA_NEXT_PINPOINTS

    vision = dict(VISION_CONFIGS["llava"]["vision_config"], image_size=336, patch_size=14)
    hf = make_vision_model("llava_next", tmp_path, vision_config=vision, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    model, _ = load_model(tmp_path)
    reference = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 336},
                                                        crop_size={"height": 336, "width": 336})
    processing = dataclasses.replace(read_image_processing(reference.to_dict()), patch_size=14)
    images = preprocess_llava_next_images([drawn_image(800, 600, seed=7), drawn_image(300, 1000, seed=8)], processing)
    assert images["views"] == [5, 4]
    features = model.encode_images(mx.array(images["pixel_values"]), image_sizes=images["image_sizes"])
    inputs = hf_inputs([0], images)
    with torch.no_grad():
        expected = torch.cat(list(hf.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"])
                                  .pooler_output)).numpy()
    assert features.shape == expected.shape
    np.testing.assert_allclose(np.array(features), expected, atol=1e-4, rtol=0)
