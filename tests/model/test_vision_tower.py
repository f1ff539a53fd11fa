"""Vision towers (the encoder over patch embeddings, model/vision_tower.py) and their
projectors (model/projectors.py) against transformers' get_image_features, on tiny random
models and the two test images as our preprocessing makes them."""

import mlx.core as mx
import numpy as np
import pytest
from fixtures.vision_images import two_images
from fixtures.vision_models import PROCESSOR_KIND, VISION_CONFIGS, hf_image_features, make_vision_model
from fixtures.vision_processors import image_processor

from mlx_tfm.loading import load_model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.projectors import pixel_shuffle
from mlx_tfm.model.vision_args import VisionArgs
from mlx_tfm.model.vision_tower import VisionTower, unfold_patches
from mlx_tfm.tokenizer.images import preprocess_images, read_image_processing


def pixel_values(family: str) -> np.ndarray:
    processing = read_image_processing(image_processor(PROCESSOR_KIND[family]).to_dict())
    return preprocess_images(two_images(), processing)["pixel_values"]


@pytest.mark.parametrize("family", sorted(VISION_CONFIGS))
def test_tower_and_projector_match_transformers(family, tmp_path):
    hf = make_vision_model(family, tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    pixels = pixel_values(family)
    expected = hf_image_features(hf, family, pixels)
    ours = np.array(model.encode_images(mx.array(pixels)))
    assert ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_llava_runs_the_tower_only_to_its_feature_layer(tmp_path):
    """vision_feature_layer -2 of 2 layers: one layer runs, the second's weights are not loaded."""
    make_vision_model("llava", tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    assert len(model.vision_tower.encoder.layers) == 1
    assert "norm" not in model.vision_tower.encoder  # CLIP's post-norm is after the layer LLaVA reads


def test_patch_embedding_is_the_convolution():
    """The matmul over unfolded patches equals a stride-p convolution (MLX's own conv)."""
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((2, 3, 16, 24)).astype(np.float32)
    kernel = rng.standard_normal((5, 3, 8, 8)).astype(np.float32)
    patches = unfold_patches(mx.array(pixels), 8)  # (2, 6, 192)
    ours = patches @ mx.array(kernel.reshape(5, -1)).T
    conv = mx.conv2d(mx.array(pixels.transpose(0, 2, 3, 1)), mx.array(kernel.transpose(0, 2, 3, 1)), stride=8)
    np.testing.assert_allclose(np.array(ours), np.array(conv).reshape(2, 6, 5), atol=1e-4)


def test_pixel_shuffle_folds_each_block_of_patches():
    """Token (i, j) of a 2x2 shuffle of a 4x4 grid holds patches (2i, 2j), (2i, 2j+1),
    (2i+1, 2j), (2i+1, 2j+1) side by side (transformers' order)."""
    grid = mx.arange(16, dtype=mx.float32).reshape(1, 16, 1)  # patch k carries the number k
    shuffled = np.array(pixel_shuffle(grid, 2))[0]
    assert shuffled.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def test_a_tower_refuses_images_of_another_size():
    args = ModelArgs.from_dict(dict(kind="encoder", hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                    intermediate_size=64, own_embeddings=False, position_embedding="learned",
                                    max_position_embeddings=16, norm_type="layernorm", ffn_gated=False))
    with pytest.raises(ValueError, match="takes 32x32 images, not 48x32"):
        VisionTower(args, VisionArgs(image_size=32, patch_size=8))(mx.zeros((1, 3, 48, 32)))
