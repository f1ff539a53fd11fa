"""M-RoPE: Qwen2-VL's 3D positions against transformers' get_rope_index, the rotary they
drive, and the language model on them against transformers' whole model."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.qwen_vision_models import GRIDS, IMAGE_TOKEN, hf_vision_language_model, image_prompt, random_pixel_values
from mlx.utils import tree_flatten, tree_unflatten

from mlx_tfm.errors import UserError
from mlx_tfm.families.decoders import qwen2_args
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.mrope import MRoPE, batch_positions, decode_positions, multimodal_positions
from mlx_tfm.model.positions import RoPE
from mlx_tfm.model.qwen_vision import QwenVisionArgs, QwenVisionTower
from mlx_tfm.model.transformer import Model

STYLES = ["qwen2_vl", "qwen2_5_vl"]
PROMPTS = [image_prompt(GRIDS, [[5, 6, 7], [8, 9], [10, 11, 12, 13]]),  # two images
           image_prompt(GRIDS[:1], [[1] * 20, [3, 4, 5, 6]])]  # one image after longer text


def hf_tensors(hf_model, prefix: str) -> dict:
    return {name[len(prefix):]: mx.array(value.numpy()) for name, value in hf_model.state_dict().items()
            if name.startswith(prefix)}


def our_language_model(hf_model) -> tuple[Model, mx.array]:
    """Our text stack on embedded inputs with transformers' weights, and the embedding table."""
    text = hf_model.config.text_config.to_dict()
    args = ModelArgs.from_dict({**text, **qwen2_args(text), "own_embeddings": False,
                                "rope_scaling": {"rope_type": "mrope",
                                                 "mrope_section": text["rope_parameters"]["mrope_section"]}})
    model = Model(args)
    weights = {f"model.{k}": v for k, v in hf_tensors(hf_model, "model.language_model.").items()}
    embeddings = weights.pop("model.embed_tokens.weight")
    weights["lm_head.weight"] = mx.array(hf_model.lm_head.weight.detach().numpy())
    assert sorted(weights) == sorted(name for name, _ in tree_flatten(model.parameters()))
    model.update(tree_unflatten(list(weights.items())))
    return model, embeddings


def our_tower(hf_model, style: str) -> QwenVisionTower:
    tower = QwenVisionTower(QwenVisionArgs.from_dict(hf_model.config.vision_config.to_dict(), style))
    weights = hf_tensors(hf_model, "model.visual.")
    weights["patch_embed.proj.weight"] = weights["patch_embed.proj.weight"].reshape(tower.args.hidden_size, -1)
    tower.update(tree_unflatten(list(weights.items())))
    return tower


def embedded(ids: list[int], embeddings: mx.array, features: mx.array) -> mx.array:
    """(1, L, D): the token embeddings with the image features in the image tokens' places."""
    h = embeddings[mx.array(ids)]
    places = np.flatnonzero(np.array(ids) == IMAGE_TOKEN)
    h[mx.array(places)] = features
    return h[None]


def hf_inputs(ids: list[int], pixel_values: np.ndarray) -> dict:
    """The whole model's inputs, as transformers' processor returns them for one prompt."""
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, pixel_values=torch.from_numpy(pixel_values), image_grid_thw=torch.tensor(GRIDS),
                mm_token_type_ids=(input_ids == IMAGE_TOKEN).int())


def hf_rope_index(hf_model, prompts, grids):
    ids = torch.tensor(prompts)
    positions, deltas = hf_model.model.get_rope_index(ids, (ids == IMAGE_TOKEN).int(), torch.tensor(grids))
    return positions.numpy(), deltas[:, 0].tolist()


@pytest.mark.parametrize("style", STYLES)
def test_positions_match_get_rope_index(style):
    hf_model = hf_vision_language_model(style)
    for ids, grids in zip(PROMPTS, [GRIDS, GRIDS[:1]]):
        expected, deltas = hf_rope_index(hf_model, [ids], grids)
        positions, delta = multimodal_positions(ids, IMAGE_TOKEN, grids, 2)
        np.testing.assert_array_equal(positions, expected[:, 0])
        assert delta == deltas[0] and delta < 0  # the images' rows and columns take fewer positions
    same_length = [PROMPTS[0], PROMPTS[0][::-1]]  # two rows, the second with its images reversed
    expected, deltas = hf_rope_index(hf_model, same_length, GRIDS + GRIDS[::-1])
    positions, ours = batch_positions(same_length, IMAGE_TOKEN, GRIDS + GRIDS[::-1], 2)
    np.testing.assert_array_equal(np.array(positions), expected)
    assert ours == deltas


def test_equal_positions_on_every_axis_are_the_plain_rope():
    x = mx.random.normal((2, 4, 7, 16))
    offsets = mx.arange(5, 12)
    positions = mx.broadcast_to(offsets[None, None], (3, 2, 7))
    rope = MRoPE(16, 10000.0, (2, 3, 3), 512)
    np.testing.assert_allclose(np.array(rope(x, positions)), np.array(RoPE(16, False, 10000.0, None, 512)(x, 5)),
                               atol=1e-5)
    assert np.abs(np.array(rope(x, positions)) - np.array(rope(x, positions + mx.array([0, 1, 0])[:, None, None]))
                  ).max() > 1e-2  # the h axis turns its own frequencies


@pytest.mark.parametrize("style", STYLES)
def test_language_model_on_transformers_image_features_matches(style):
    """Only the language side: transformers' own image features scattered in, the same
    embedded inputs and positions, our logits against the whole model's."""
    hf_model = hf_vision_language_model(style)
    ids, pixel_values = PROMPTS[0], random_pixel_values(GRIDS, hf_model.config.vision_config)
    inputs = hf_inputs(ids, pixel_values)
    with torch.no_grad():
        expected = hf_model(**inputs).logits.numpy()
        features = torch.cat(hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
                             .pooler_output).numpy()
    model, embeddings = our_language_model(hf_model)
    positions, _ = batch_positions([ids], IMAGE_TOKEN, GRIDS, 2)
    logits = model(embedded(ids, embeddings, mx.array(features)), positions=positions)
    assert np.abs(expected).std() > 0.5
    np.testing.assert_allclose(np.array(logits), expected, atol=1e-4, rtol=1e-4)
    plain = model(embedded(ids, embeddings, mx.array(features)))  # without the images' positions
    assert np.abs(np.array(plain) - expected).max() > 1e-2


@pytest.mark.parametrize("style", STYLES)
def test_our_tower_and_language_model_match_the_whole_model(style):
    hf_model = hf_vision_language_model(style, seed=1)
    ids, pixel_values = PROMPTS[0], random_pixel_values(GRIDS, hf_model.config.vision_config, seed=1)
    with torch.no_grad():
        expected = hf_model(**hf_inputs(ids, pixel_values)).logits.numpy()
    model, embeddings = our_language_model(hf_model)
    features = our_tower(hf_model, style)(mx.array(pixel_values), GRIDS)
    positions, _ = batch_positions([ids], IMAGE_TOKEN, GRIDS, 2)
    logits = model(embedded(ids, embeddings, features), positions=positions)
    np.testing.assert_allclose(np.array(logits), expected, atol=1e-4, rtol=1e-4)


def test_cached_decode_after_the_prompt_equals_the_full_forward():
    """Prefill the image prompt with its positions, then decode text at offset + rope_delta:
    the same logits as one forward over everything."""
    hf_model = hf_vision_language_model("qwen2_5_vl")
    model, embeddings = our_language_model(hf_model)
    prompt, answer = PROMPTS[0], [20, 21, 22, 23]
    features = mx.random.normal((sum(t * h * w for t, h, w in GRIDS) // 4, 64))
    everything = embedded(prompt + answer, embeddings, features)
    positions, _ = batch_positions([prompt + answer], IMAGE_TOKEN, GRIDS, 2)
    full = np.array(model(everything, positions=positions))
    prompt_positions, deltas = batch_positions([prompt], IMAGE_TOKEN, GRIDS, 2)
    cache = model.make_cache()
    steps = [np.array(model(everything[:, : len(prompt)], cache=cache, positions=prompt_positions))]
    for i in range(len(answer)):
        step_positions = decode_positions(cache[0].offset, deltas)
        steps.append(np.array(model(everything[:, len(prompt) + i : len(prompt) + i + 1], cache=cache,
                                    positions=step_positions)))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4, rtol=1e-4)


def test_bad_prompts_and_sections_are_one_line_errors():
    with pytest.raises(UserError, match="an image of 24 merged patches has 3 image tokens"):
        multimodal_positions([1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 2], IMAGE_TOKEN, GRIDS[:1], 2)
    with pytest.raises(UserError, match="more image-token runs than images"):
        multimodal_positions([IMAGE_TOKEN, 1, IMAGE_TOKEN], IMAGE_TOKEN, [[1, 2, 2]], 2)
    with pytest.raises(UserError, match="more images than image-token runs"):
        multimodal_positions([IMAGE_TOKEN, 1], IMAGE_TOKEN, [[1, 2, 2], [1, 2, 2]], 2)
    with pytest.raises(ValueError, match=r"mrope_section \[2, 2, 2\] sums to 6, not head_dim / 2 = 8"):
        MRoPE(16, 10000.0, (2, 2, 2), 512)


def test_prefill_in_chunks_equals_one_prefill():
    """The prompt's positions cut with its chunks: two chunks through the cache == one."""
    hf_model = hf_vision_language_model("qwen2_vl")
    model, embeddings = our_language_model(hf_model)
    prompt = PROMPTS[0]
    features = mx.random.normal((sum(t * h * w for t, h, w in GRIDS) // 4, 64))
    inputs = embedded(prompt, embeddings, features)
    positions, _ = batch_positions([prompt], IMAGE_TOKEN, GRIDS, 2)
    whole = np.array(model(inputs, cache=model.make_cache(), positions=positions))
    cache, cut = model.make_cache(), 17  # inside the first image
    chunks = [model(inputs[:, :cut], cache=cache, positions=positions[:, :, :cut]),
              model(inputs[:, cut:], cache=cache, positions=positions[:, :, cut:])]
    np.testing.assert_allclose(np.concatenate([np.array(c) for c in chunks], axis=1), whole, atol=1e-4, rtol=1e-4)
