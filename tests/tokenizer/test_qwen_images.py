"""Qwen2-VL image preprocessing against transformers' PIL image processor and processor."""

import numpy as np
import pytest
from fixtures.qwen_vision_models import gradient_image, shapes_image, vision_tokenizer_folder
from PIL import Image
from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.processing_utils import ProcessorMixin

from mlx_tfm.errors import UserError
from mlx_tfm.tokenizer import load_tokenizer
from mlx_tfm.tokenizer.qwen_images import (
    QwenImageSettings,
    expand_image_tokens,
    image_token_counts,
    preprocess_images,
    smart_resize,
)

# (min_pixels, max_pixels): the defaults; a cap that shrinks both images; a floor that grows them
PIXEL_BOUNDS = [(56 * 56, 28 * 28 * 1280), (56 * 56, 28 * 28 * 6), (28 * 28 * 40, 28 * 28 * 1280)]


@pytest.mark.parametrize("bounds", PIXEL_BOUNDS)
def test_pixel_values_and_grids_match_transformers(bounds):
    min_pixels, max_pixels = bounds
    images = [gradient_image(100, 80), shapes_image(150, 60)]
    reference = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)(images=images)
    pixel_values, grids = preprocess_images(images, QwenImageSettings(min_pixels=min_pixels, max_pixels=max_pixels))
    np.testing.assert_array_equal(grids, reference["image_grid_thw"])
    assert grids[0].tolist() != grids[1].tolist()  # two sizes: the dynamic resolution differs
    assert pixel_values.dtype == np.float32 and pixel_values.shape == reference["pixel_values"].shape
    np.testing.assert_allclose(pixel_values, reference["pixel_values"], atol=1e-5, rtol=0)


def test_smart_resize_matches_transformers_over_many_sizes():
    for height in (1, 13, 28, 57, 100, 333, 1000, 4000):
        for width in (5, 28, 90, 640, 2999):
            if max(height, width) / min(height, width) > 200:
                continue
            for bounds in PIXEL_BOUNDS:
                assert smart_resize(height, width, 28, *bounds) == hf_smart_resize(height, width, 28, *bounds)


def test_settings_read_a_preprocessor_config():
    settings = QwenImageSettings.from_dict({"size": {"shortest_edge": 3136, "longest_edge": 12845056},
                                            "patch_size": 16, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5]})
    assert (settings.min_pixels, settings.max_pixels, settings.patch_size, settings.factor) == (3136, 12845056, 16, 32)
    assert settings.image_mean == (0.5, 0.5, 0.5) and settings.temporal_patch_size == 2
    older = QwenImageSettings.from_dict({"min_pixels": 100, "max_pixels": 2000})
    assert (older.min_pixels, older.max_pixels) == (100, 2000)


def test_a_greyscale_image_is_taken_as_rgb():
    grey = gradient_image().convert("L")
    reference = Qwen2VLImageProcessorPil()(images=[grey])
    pixel_values, _ = preprocess_images([grey])
    np.testing.assert_allclose(pixel_values, reference["pixel_values"], atol=1e-5, rtol=0)


class ImageOnlyProcessor(Qwen2VLProcessor):
    """transformers' Qwen2-VL processor without its video processor (which needs
    torchvision, not installed here); the image path is the processor's own."""

    def __init__(self, image_processor, tokenizer):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer)


def test_expanded_prompt_tokens_match_the_transformers_processor(tmp_path):
    folder = vision_tokenizer_folder(tmp_path)
    processor = ImageOnlyProcessor(Qwen2VLImageProcessorPil(),
                                   PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")))
    images = [gradient_image(100, 80), shapes_image(150, 60)]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"<|im_start|>user\n{image}What is in{image} the image?<|im_end|>\n<|im_start|>assistant\n"
    reference = processor(text=[prompt], images=images)
    _, grids = preprocess_images(images)
    expanded = expand_image_tokens(prompt, grids, merge_size=2)
    ids = load_tokenizer(folder).encode(expanded, add_special_tokens=False)
    assert ids == list(reference["input_ids"][0])
    pad_id = processor.image_token_id
    assert ids.count(pad_id) == sum(image_token_counts(grids, 2)) == sum(g.prod() // 4 for g in grids)


def test_placeholder_count_must_match_the_images():
    grids = np.array([[1, 4, 4], [1, 2, 6]])
    with pytest.raises(UserError, match="1 image placeholders for 2 images"):
        expand_image_tokens("<|image_pad|> and nothing", grids, 2)


def test_bad_images_are_one_line_errors():
    with pytest.raises(UserError, match="aspect ratio 250 is over 200"):
        preprocess_images([Image.new("RGB", (500, 2))])
    with pytest.raises(UserError, match="no images"):
        preprocess_images([])
