"""LLaVA-NeXT's anyres preprocessing (mlx_tfm/tokenizer/llava_next_images.py) against
transformers' slow LlavaNextImageProcessor, and its prompt expansion against
LlavaNextProcessor, on the two test images (which fit different resolutions)."""

import dataclasses

import numpy as np
import pytest
from fixtures.vision_images import drawn_image, two_images
from fixtures.vision_processors import image_processor, processor

from mlx_tfm.errors import UserError
from mlx_tfm.model.anyres import select_best_resolution
from mlx_tfm.tokenizer.image_tokens import expand_image_placeholders, read_image_prompt
from mlx_tfm.tokenizer.images import read_image_processing
from mlx_tfm.tokenizer.llava_next_images import preprocess_llava_next_images


def our_processing(reference):
    return dataclasses.replace(read_image_processing(reference.to_dict()), patch_size=8)


def test_the_two_test_images_fit_different_resolutions():
    pinpoints = image_processor("llava_next").image_grid_pinpoints
    sizes = [(image.height, image.width) for image in two_images()]
    assert [select_best_resolution(*size, pinpoints) for size in sizes] == [(32, 64), (64, 32)]


@pytest.mark.parametrize("images", [two_images(), [drawn_image(90, 30, seed=5), drawn_image(20, 20, seed=6)]],
                         ids=["test-images", "wide-and-small"])
def test_pixel_values_and_sizes_match_transformers(images):
    reference = image_processor("llava_next")
    ours = preprocess_llava_next_images(images, our_processing(reference))
    start = 0
    for i, image in enumerate(images):
        theirs = reference(images=[image], return_tensors="np")
        expected = np.asarray(theirs["pixel_values"])[0]  # (views, 3, 32, 32)
        got = ours["pixel_values"][start:start + ours["views"][i]]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
        assert (ours["image_sizes"][start:start + ours["views"][i]] == np.asarray(theirs["image_sizes"])[0]).all()
        start += ours["views"][i]


def test_placeholders_expand_to_the_processors_input_ids():
    reference = processor("llava_next", tokens_per_view=0)
    images = preprocess_llava_next_images(two_images(), our_processing(reference.image_processor))
    config = {"vision_config": {"image_size": 32, "patch_size": 8}, "vision_feature_select_strategy": "default"}
    prompt = read_image_prompt("llava_next", {"patch_size": 8, "num_additional_image_tokens": 1}, config)
    text = "user: describe <image> and <image> assistant:"
    ours = reference.tokenizer(expand_image_placeholders(text, prompt, images["rows"], images["cols"]),
                               add_special_tokens=False)["input_ids"]
    theirs = [int(t) for t in reference(text=text, images=two_images(), return_tensors="np")["input_ids"][0]]
    assert ours == theirs
    image_id = reference.tokenizer.convert_tokens_to_ids("<image>")
    # the whole view's 16, then 4 rows of 6 + newline and 8 rows of 4 + newline
    assert ours.count(image_id) == (16 + 4 * 7) + (16 + 8 * 5)


def test_a_processor_without_pinpoints_is_one_line():
    config = {**image_processor("llava_next").to_dict(), "image_grid_pinpoints": None}
    with pytest.raises(UserError, match="without image_grid_pinpoints") as error:
        read_image_processing(config)
    assert "\n" not in str(error.value)
