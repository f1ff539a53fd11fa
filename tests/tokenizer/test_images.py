"""Image preprocessing without torch (mlx_tfm/tokenizer/images.py) against transformers'
slow (PIL) image processors, and the one-line refusals of bad image files."""

import struct
import zlib

import numpy as np
import pytest
from fixtures.vision_images import drawn_image, two_images
from fixtures.vision_processors import image_processor, processor

from mlx_tfm.errors import UserError
from mlx_tfm.tokenizer.image_tokens import expand_image_placeholders, read_image_prompt
from mlx_tfm.tokenizer.images import load_image, preprocess_images, read_image_processing

def reference(name: str):
    processor = image_processor(name)
    return processor, processor.to_dict()


@pytest.mark.parametrize("name", ["clip", "siglip", "gemma3", "idefics3", "smolvlm"])
def test_pixel_values_match_transformers(name):
    processor, config = reference(name)
    ours = preprocess_images(two_images(), read_image_processing(config))
    for i, image in enumerate(two_images()):
        theirs = processor(images=[image], return_tensors="np", **(
            {"return_row_col_info": True} if name in ("idefics3", "smolvlm") else {}))
        expected = np.asarray(theirs["pixel_values"]).reshape(-1, *ours["pixel_values"].shape[1:])
        start = sum(ours["views"][:i])
        got = ours["pixel_values"][start:start + ours["views"][i]]
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
        if name in ("idefics3", "smolvlm"):
            assert (ours["rows"][i], ours["cols"][i]) == (theirs["rows"][0][0], theirs["cols"][0][0])


def test_idefics3_grids_differ_between_the_two_images():
    _, config = reference("idefics3")
    ours = preprocess_images(two_images(), read_image_processing(config))
    assert list(zip(ours["rows"], ours["cols"])) == [(3, 3), (3, 2)]
    assert ours["views"] == [10, 7]


def test_transparency_is_composited_onto_white():
    rgba = drawn_image(8, 8, seed=3).convert("RGBA")
    rgba.putalpha(0)
    assert np.asarray(load_image(rgba)).min() == 255


def test_a_file_that_is_not_an_image_is_one_line(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not an image at all")
    with pytest.raises(UserError, match="is not an image") as error:
        load_image(path)
    assert "\n" not in str(error.value)


def test_a_truncated_png_is_one_line(tmp_path):
    path = tmp_path / "cut.png"
    drawn_image(64, 64, seed=4).save(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated") as error:
        load_image(path)
    assert "\n" not in str(error.value)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width x height`` (grey, 8 bits) with a few bytes of data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [30000, 12000])  # 12000^2 is over the limit but under twice it: PIL only warns
def test_a_decompression_bomb_is_refused_before_decoding(side):
    with pytest.raises(UserError, match="decompression bomb") as error:
        load_image(png_header_only(side, side))
    assert "\n" not in str(error.value)


def test_an_unknown_processor_is_one_line():
    with pytest.raises(UserError, match="'FancyImageProcessor' is not supported"):
        read_image_processing({"image_processor_type": "FancyImageProcessor"})


# -- the prompt's image tokens ---------------------------------------------------------

PROMPTS = {"llava": "user: describe <image> and <image> assistant:",
           "idefics3": "user: describe <image> and <image> assistant:",
           "gemma3": "user: describe <start_of_image> and <start_of_image> assistant:"}


@pytest.mark.parametrize("family", sorted(PROMPTS))
def test_placeholders_expand_to_the_processors_input_ids(family):
    reference_processor = processor(family, tokens_per_view=3)
    kind = {"llava": "clip", "idefics3": "idefics3", "gemma3": "gemma3"}[family]
    images = preprocess_images(two_images(), read_image_processing(image_processor(kind).to_dict()))
    config = {"vision_config": {"image_size": 32, "patch_size": 8}, "vision_feature_select_strategy": "default",
              "mm_tokens_per_image": 3}
    settings = {"patch_size": 8, "num_additional_image_tokens": 1, "image_seq_len": 3}
    prompt = read_image_prompt(family, settings, config)
    text = expand_image_placeholders(PROMPTS[family], prompt, images["rows"], images["cols"])
    theirs = reference_processor(text=PROMPTS[family], images=[two_images()] if family == "idefics3" else two_images(),
                                 return_tensors="np")
    ours = reference_processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    theirs_ids = [int(t) for t in theirs["input_ids"][0]]
    assert ours == theirs_ids[len(theirs_ids) - len(ours):]  # Gemma's processor may put BOS first
    image_id = reference_processor.tokenizer.convert_tokens_to_ids(prompt.image_token)
    assert ours.count(image_id) == {"llava": 2 * 16, "idefics3": (10 + 7) * 3, "gemma3": 2 * 3}[family]


def test_a_placeholder_count_unlike_the_images_is_one_line():
    prompt = read_image_prompt("llava", {"patch_size": 8}, {"vision_config": {"image_size": 32}})
    with pytest.raises(UserError, match="1 <image> placeholder"):
        expand_image_placeholders("describe <image>", prompt, [0, 0], [0, 0])


def test_gemma3_pan_and_scan_is_refused_in_one_line():
    with pytest.raises(UserError, match="pan-and-scan crops are not supported"):
        read_image_processing({"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True,
                               "size": {"height": 32, "width": 32}})
