"""LFM2-VL's image preprocessing (tokenizer/lfm2_vl_images.py, fixed_point_resize.py) against
transformers' Lfm2VlProcessor (run with the torchvision stand-in, fixtures/lfm2_vl_processors.py):
pixel values, masks, spatial shapes and the expanded prompt's token ids for images that tile,
one that is one view and one that grows, at test sizes (with splitting or the thumbnail off)
and at transformers' defaults; the resize against torch's own uint8 kernel; bad settings
and inputs as one-line errors."""

import numpy as np
import pytest
from fixtures.lfm2_vl_processors import reference_runs, save_processor_files
from fixtures.vision_images import drawn_image, two_images

from mlx_tfm.errors import UserError
from mlx_tfm.tokenizer import load_tokenizer
from mlx_tfm.tokenizer.fixed_point_resize import resize_uint8
from mlx_tfm.tokenizer.lfm2_vl_images import read_lfm2_vl_processing
from mlx_tfm.tokenizer.vision_processor import read_vision_processor

PROMPT = "user: describe <image> and <image> <image> a <image> assistant:"


def four_images() -> list:
    """70x52 (2x3 tiles), 41x77 (2x1 tiles), 30x20 (one view), 12x9 (grown to the fewest tokens)."""
    return [*two_images(), drawn_image(30, 20, seed=3), drawn_image(12, 9, seed=4)]


def lfm2_vl_processor(folder):
    return read_vision_processor(folder, load_tokenizer(folder), {"model_type": "lfm2_vl"})


# name -> (preprocessor_config.json: the test sizes with these changes, or transformers' own
# defaults (16-pixel patches, 512-pixel tiles, 64 to 256 tokens); the prompt; its images)
CASES = {
    "tiles": ({}, PROMPT, four_images),
    "no-splitting": ({"do_image_splitting": False}, PROMPT, four_images),
    "no-thumbnail": ({"use_thumbnail": False, "min_tiles": 3}, PROMPT, four_images),
    "hub-defaults": ({"image_processor_type": "Lfm2VlImageProcessor"}, "describe <image> and <image>",
                     lambda: [drawn_image(1100, 800, seed=5), drawn_image(300, 200, seed=6)]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each case's folder and transformers' inputs, all run in one child process."""
    scratch = tmp_path_factory.mktemp("lfm2_vl_references")
    folders = {}
    for name, (settings, _, _) in CASES.items():
        folders[name] = (save_processor_files(scratch / name, settings) if name == "hub-defaults"
                         else save_processor_files(scratch / name, **settings))
    jobs = [(folders[name], text, images()) for name, (_, text, images) in CASES.items()]
    return dict(zip(CASES, zip(folders.values(), reference_runs(jobs, scratch))))


@pytest.mark.parametrize("case", CASES)
def test_pixels_masks_shapes_and_ids_match_transformers(references, case):
    folder, expected = references[case]
    _, text, images = CASES[case]
    ids, pixel_values, tower_inputs = lfm2_vl_processor(folder).prepare_inputs(text, images())
    assert ids == expected["input_ids"].tolist()
    assert pixel_values.dtype == np.float32 and pixel_values.shape == expected["pixel_values"].shape
    np.testing.assert_allclose(pixel_values, expected["pixel_values"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(tower_inputs["pixel_attention_mask"], expected["pixel_attention_mask"])
    np.testing.assert_array_equal(tower_inputs["spatial_shapes"], expected["spatial_shapes"])
    if case in ("tiles", "hub-defaults"):  # tiles and thumbnails, one-view and grown images are all there
        assert len(expected["spatial_shapes"]) > len(images()) + 2


@pytest.mark.parametrize("size, out", [((52, 70), (64, 96)), ((77, 41), (24, 16)), ((40, 300), (40, 37)),
                                       ((9, 12), (16, 24)), ((512, 384), (31, 500))])
def test_the_resize_is_torchs_uint8_antialiased_bilinear_to_the_bit(size, out):
    import torch

    pixels = np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)
    image = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()[None]  # (1, 3, H, W) uint8
    expected = torch.nn.functional.interpolate(image, size=out, mode="bilinear", align_corners=False,
                                               antialias=True)[0].permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(resize_uint8(pixels, *out), expected)


@pytest.mark.parametrize("settings, words", [
    ({"resample": 3}, "bilinear filter only"),
    ({"do_pad": False}, "set do_pad to true"),
    ({"min_tiles": 4, "max_tiles": 2}, "min_tiles (4) is over its max_tiles (2)"),
    ({"image_processor_type": "SiglipImageProcessor"}, "is not LFM2-VL's"),
])
def test_settings_it_does_not_do_are_one_line_errors(settings, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")) as error:
        read_lfm2_vl_processing(settings)
    assert "\n" not in str(error.value)


def test_bad_inputs_are_one_line_errors(tmp_path):
    processor = lfm2_vl_processor(save_processor_files(tmp_path))
    (tmp_path / "not_an_image.png").write_bytes(b"hello")
    cases = [(("describe <image>", [tmp_path / "not_an_image.png"]), "is not an image"),
             (("describe <image> <image>", two_images()[:1]), "2 <image> placeholder"),
             (("describe <image>", [drawn_image(2000, 1, seed=7)]), "aspect ratio is too extreme")]
    for (text, images), words in cases:
        with pytest.raises(UserError, match=words) as error:
            processor.prepare_inputs(text, images)
        assert "\n" not in str(error.value)
