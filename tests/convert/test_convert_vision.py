"""Converting image-text folders (mlx_tfm/families/vision.py): -q quantizes the language
model and keeps the vision tower and projector in float, unless --quantize-vision asks; the
converted folder still computes transformers' image features."""

import mlx.core as mx
import numpy as np
import pytest
from fixtures.vision_images import two_images
from fixtures.vision_models import PROCESSOR_KIND, hf_image_features, make_vision_model
from fixtures.vision_processors import image_processor

from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model
from mlx_tfm.tokenizer.images import preprocess_images, read_image_processing

QUIET = dict(log=lambda *_: None)


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_quantizing_keeps_the_vision_side_in_float(family, tmp_path):
    hf = make_vision_model(family, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "q4", quantize=True, q_group_size=32, **QUIET)
    weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    vision = [n for n in weights if "vision" in n or "projector" in n or "connector" in n]
    text = [n for n in weights if n.endswith("q_proj.weight") and n not in vision]
    assert vision and not [n for n in vision if n.endswith(".scales")]
    assert text and all(weights[n].dtype == mx.uint32 for n in text)
    model, _ = load_model(tmp_path / "q4")
    processing = read_image_processing(image_processor(PROCESSOR_KIND[family]).to_dict())
    pixels = preprocess_images(two_images(), processing)["pixel_values"]
    np.testing.assert_allclose(np.array(model.encode_images(mx.array(pixels))), hf_image_features(hf, family, pixels),
                               atol=1e-4, rtol=0)
    assert (tmp_path / "q4" / "preprocessor_config.json").is_file()


def test_quantize_vision_quantizes_the_tower_too(tmp_path):
    make_vision_model("llava", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "q4", quantize=True, q_group_size=32, quantize_vision=True, **QUIET)
    weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    assert "multi_modal_projector.linear_1.scales" in weights
    assert any(n.startswith("vision_tower.") and n.endswith(".scales") for n in weights)
    model, _ = load_model(tmp_path / "q4")
    assert model.encode_images(mx.zeros((1, 3, 32, 32))).shape == (16, 64)
