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


# the hub's LLaVA-NeXT sizes: 336-pixel views of 14-pixel patches, transformers' default resolutions
HUB_SIZES = [(h, w) for h in (1, 17, 200, 336, 480, 673, 1000, 2048) for w in (3, 101, 336, 640, 999, 1500)]


def test_token_counts_and_unpadding_match_transformers_at_the_hubs_sizes():
    """For images of many shapes: the prompt's tokens equal LlavaNextProcessor's count, and
    the unpadded grid is the part transformers' unpad_image keeps of the packed features."""
    import torch
    import transformers
    from fixtures.vision_processors import word_tokenizer
    from transformers.models.llava_next.modeling_llava_next import unpad_image

    from mlx_tfm.families.vision import LLAVA_NEXT_PINPOINTS
    from mlx_tfm.model.anyres import anyres_grid, unpadded_grid
    from mlx_tfm.tokenizer.image_tokens import image_token_count

    reference = transformers.LlavaNextProcessor(
        image_processor=transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 336},
                                                                crop_size={"height": 336, "width": 336}),
        tokenizer=word_tokenizer(), patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1)
    config = {"vision_config": {"image_size": 336, "patch_size": 14}, "vision_feature_select_strategy": "default"}
    prompt = read_image_prompt("llava_next", {"patch_size": 14, "num_additional_image_tokens": 1}, config)
    for height, width in HUB_SIZES:
        rows, cols = anyres_grid(height, width, LLAVA_NEXT_PINPOINTS, 336)
        top, kept_rows, left, kept_cols = unpadded_grid(height, width, rows * 24, cols * 24)
        expected = reference._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0]
        assert image_token_count(prompt, kept_rows, kept_cols) == expected, (height, width)
        grid = torch.arange(rows * 24 * cols * 24).reshape(1, rows * 24, cols * 24)  # (1, feature rows, columns)
        kept = unpad_image(grid, (height, width))[0]
        assert torch.equal(grid[0, top:top + kept_rows, left:left + kept_cols], kept), (height, width)
