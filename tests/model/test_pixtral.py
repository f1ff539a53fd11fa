"""Mistral 3 and Pixtral 12B (LLaVA) with the Pixtral tower (model/pixtral_vision.py,
families/pixtral.py, tokenizer/pixtral_images.py) against transformers 5 on tiny random
models with the two test images, which resize to different sizes: pixel values, the
expanded prompt, image features, logits and greedy tokens of the whole
*ForConditionalGeneration, and our cached decoding against our own full forward."""

import mlx.core as mx
import numpy as np
import pytest
from fixtures.image_decoding import cached_and_full_logits, greedy_with_images
from fixtures.pixtral_models import (
    IMAGE_TOKEN,
    RESIZE_MULTIPLE,
    hf_pixtral_inputs,
    make_pixtral_model,
    pixtral_image_processor,
    word_tokenizer,
)
from fixtures.vision_images import two_images

from mlx_tfm.errors import UserError
from mlx_tfm.loading import load_model
from mlx_tfm.model.pixtral_vision import axial_rope_angles, merge_patches
from mlx_tfm.tokenizer.image_tokens import expand_image_placeholders, read_image_prompt
from mlx_tfm.tokenizer.pixtral_images import (
    preprocess_pixtral_images,
    read_pixtral_processing,
)

FAMILIES = ("mistral3", "llava")
CONFIG = {"model_type": "mistral3", "vision_config": {"patch_size": 4}}  # merge 2: Mistral 3's default
# each test image's token grid, by family: (24 / 8) x (32 / 8), (32 / 8) x (24 / 8); no merge: sides of 4
GRIDS = {"mistral3": [(3, 4), (4, 3)], "llava": [(6, 8), (8, 5)]}


@pytest.fixture(scope="module", params=FAMILIES)
def pixtral(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_pixtral_model(folder, request.param)
    model, _ = load_model(folder)
    return request.param, hf, model


def family_config(family: str) -> dict:
    return CONFIG if family == "mistral3" else {"model_type": "llava", "vision_config": {"patch_size": 4}}


def our_inputs(family: str = "mistral3") -> dict:
    processing = read_pixtral_processing(pixtral_image_processor().to_dict(), family_config(family))
    return preprocess_pixtral_images(two_images(), processing)


@pytest.mark.parametrize("family", FAMILIES)
def test_pixel_values_and_sizes_match_the_slow_processor(family):
    ours, theirs = our_inputs(family), hf_pixtral_inputs(two_images(), family)
    multiple = RESIZE_MULTIPLE[family]
    assert ours["image_sizes"].tolist() == theirs["image_sizes"].tolist() == [
        [rows * multiple, cols * multiple] for rows, cols in GRIDS[family]]
    np.testing.assert_allclose(ours["pixel_values"], theirs["pixel_values"], atol=1e-5, rtol=0)


def test_the_expanded_prompt_is_the_token_grid_of_each_image(pixtral):
    """PixtralProcessor's layout (it needs torchvision, so it is written out here as a
    list): per image ``rows`` lines of ``cols`` [IMG], each ended by [IMG_BREAK], the last
    by [IMG_END]; the [IMG] count per image is transformers' feature count for it."""

    family, hf, _ = pixtral
    tokenizer, inputs = word_tokenizer(), our_inputs(family)
    text = "[INST] describe [IMG] and [IMG] [/INST]"
    prompt = read_image_prompt("pixtral", {}, family_config(family))
    expanded = expand_image_placeholders(text, prompt, inputs["rows"], inputs["cols"])
    expected = ["[INST]", "describe"]
    for rows, cols, after in zip(inputs["rows"], inputs["cols"], (["and"], ["[/INST]"])):
        grid = [token for _ in range(rows) for token in ["[IMG]"] * cols + ["[IMG_BREAK]"]]
        expected += grid[:-1] + ["[IMG_END]"] + after
    assert tokenizer(expanded, add_special_tokens=False)["input_ids"] == tokenizer.convert_tokens_to_ids(expected)
    assert list(zip(inputs["rows"], inputs["cols"])) == GRIDS[family]
    assert [r * c for r, c in GRIDS[family]] == [len(f) for f in hf_features(hf, family)]


def hf_features(hf, family: str) -> list:
    import torch

    inputs = hf_pixtral_inputs(two_images(), family)
    with torch.no_grad():
        return hf.model.get_image_features(torch.tensor(inputs["pixel_values"]),
                                           image_sizes=torch.tensor(inputs["image_sizes"])).pooler_output


def test_image_features_match_transformers(pixtral):
    import torch

    family, hf, model = pixtral
    inputs = hf_pixtral_inputs(two_images(), family)
    ours = model.encode_images(mx.array(inputs["pixel_values"]), inputs["image_sizes"])
    np.testing.assert_allclose(np.array(ours), torch.cat(hf_features(hf, family)).numpy(), atol=1e-4, rtol=0)


def prompt_ids(features_per_image: list[int]) -> list[int]:
    ids = [1, 7]
    for count in features_per_image:
        ids += [IMAGE_TOKEN] * count + [9, 11]
    return ids + [12, 13]


def test_logits_and_greedy_tokens_match_transformers(pixtral):
    import torch

    family, hf, model = pixtral
    inputs = hf_pixtral_inputs(two_images(), family)
    features = model.encode_images(mx.array(inputs["pixel_values"]), inputs["image_sizes"])
    ids = prompt_ids([rows * cols for rows, cols in GRIDS[family]])
    hf_inputs = {"input_ids": torch.tensor([ids]), "pixel_values": torch.tensor(inputs["pixel_values"]),
                 "image_sizes": torch.tensor(inputs["image_sizes"])}
    with torch.no_grad():
        expected = hf(**hf_inputs).logits[0].numpy()
        hf_tokens = hf.generate(**hf_inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
    np.testing.assert_allclose(np.array(model(mx.array([ids]), image_features=features)[0]), expected, atol=1e-4,
                               rtol=0)
    assert greedy_with_images(model, ids, features, 6) == hf_tokens


def test_cached_decoding_equals_the_full_forward(pixtral):
    family, _, model = pixtral
    inputs = our_inputs(family)
    features = model.encode_images(mx.array(inputs["pixel_values"]), inputs["image_sizes"])
    ids, continuation = prompt_ids([rows * cols for rows, cols in GRIDS[family]]), [7, 200, 42, 11]
    cached, full = cached_and_full_logits(model, ids, features, continuation)
    np.testing.assert_allclose(cached, full, atol=1e-4, rtol=0)


def test_axial_rope_turns_the_first_quarter_by_row_and_the_second_by_column():
    """An independent reading of Pixtral's table: frequency j of the 1D table over hd is
    theta^(-2j / hd); rows take the even j, columns the odd j."""
    head_dim, theta = 8, 100.0
    angles = np.array(axial_rope_angles(2, 3, head_dim, theta))  # (6, 4)
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)  # (4,)
    patch = 1 * 3 + 2  # row 1, column 2
    np.testing.assert_allclose(angles[patch], [1 * freq[0], 1 * freq[2], 2 * freq[1], 2 * freq[3]], rtol=1e-6)


def test_the_patch_merger_orders_each_block_as_torch_unfold():
    import torch

    states = np.random.default_rng(0).normal(size=(4 * 6, 3)).astype(np.float32)  # a 4 x 6 grid of width 3
    grid = torch.tensor(states).view(4, 6, 3).permute(2, 0, 1)[None]
    expected = torch.nn.functional.unfold(grid, kernel_size=2, stride=2).view(3 * 4, -1).t().numpy()
    np.testing.assert_array_equal(np.array(merge_patches(mx.array(states), 4, 6, 2)), expected)


def test_another_processor_is_one_line():
    with pytest.raises(UserError, match="'CLIPImageProcessor' is not Pixtral's"):
        read_pixtral_processing({"image_processor_type": "CLIPImageProcessor"}, CONFIG)


TEXT = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 256}


def test_several_feature_layers_are_one_line():
    from mlx_tfm.families import model_args_from_config

    with pytest.raises(UserError, match="several vision_feature_layer"):
        model_args_from_config({"model_type": "mistral3", "text_config": TEXT, "vision_feature_layer": [-1, -2]})


def test_pixtral_12b_drops_no_patch():
    """LLaVA's "default" strategy would drop the packed sequence's first patch: refused."""
    from mlx_tfm.families import model_args_from_config

    config = {"model_type": "llava", "text_config": TEXT, "vision_config": {"model_type": "pixtral"}}
    with pytest.raises(UserError, match="vision_feature_select_strategy 'full' only"):
        model_args_from_config(config)
    args = model_args_from_config({**config, "vision_feature_select_strategy": "full"})
    assert args.vision["tower_kind"] == "pixtral" and args.vision["tower_fields"]["projector"] == "llava"


def test_a_folder_without_the_tower_loads_the_language_model_alone(tmp_path):
    """mlx-lm's conversions drop the tower and projector but keep vision_config."""
    import shutil

    import torch

    from mlx_tfm.model.transformer import Model

    hf = make_pixtral_model(tmp_path / "hf")
    shutil.copytree(tmp_path / "hf", tmp_path / "text", ignore=shutil.ignore_patterns("*.safetensors"))
    weights = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    mx.save_safetensors(str(tmp_path / "text" / "model.safetensors"),
                        {n: w for n, w in weights.items() if "vision_tower" not in n and "projector" not in n})
    model, _ = load_model(tmp_path / "text")
    assert isinstance(model, Model) and model.args.vision is None
    ids = [1, 7, 9, 11, 200, 42]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), expected, atol=1e-4, rtol=0)
