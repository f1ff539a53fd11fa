"""mlx-vlm's folders (``mlx_vlm.convert``) load here with the same weights and logits, and our
converted folders load in mlx-vlm, for LLaVA 1.5, LLaVA-NeXT, Idefics3, SmolVLM, Gemma 3, Qwen3.5 and
Qwen3.5-MoE (tiny random models of transformers, as tests/convert/test_convert_architectures.py
does for mlx-lm)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures.vision_images import two_images
from fixtures.vision_models import VISION_CONFIGS, make_vision_model
from fixtures.qwen_vision_models import PROMPT as QWEN_PROMPT
from fixtures.qwen_vision_models import QWEN3_5_STYLES, qwen_vl_folder
from fixtures.qwen_vision_models import two_images as two_qwen_images
from fixtures.vision_processors import word_tokenizer

# family -> (the config key of its image token, that token's text, its processor_config.json)
FAMILIES = {
    "llava": ("image_token_index", "<image>", {"patch_size": 8, "num_additional_image_tokens": 1,
                                               "vision_feature_select_strategy": "default"}),
    "idefics3": ("image_token_id", "<image>", {"image_seq_len": 4}),
    "smolvlm": ("image_token_id", "<image>", {"image_seq_len": 4}),
    "gemma3": ("image_token_index", "<image_soft_token>", {"image_seq_length": 4}),
}
PROMPTS = {"llava": "user: <image> describe this picture assistant:",
           "idefics3": "user: <image> describe this picture assistant:",
           "smolvlm": "user: <image> describe this picture assistant:",
           "gemma3": "user: <start_of_image> describe this picture assistant:"}


def hub_layout(folder: Path, family: str) -> None:
    """LLaVA's and Gemma 3's tower under ``vision_tower.vision_model.*``, as the hub's
    checkpoints (and transformers 4) have it: mlx-vlm reads that layout, transformers 5
    saves without it."""
    if family not in ("llava", "gemma3"):
        return
    path = folder / "model.safetensors"
    weights = mx.load(str(path))
    renamed = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): value for name, value in weights.items()}
    mx.save_safetensors(str(path), renamed, metadata={"format": "pt"})


def hf_folder(folder: Path, family: str):
    """A tiny random transformers model of ``family`` with a word tokenizer and its processor files."""
    key, image_token, settings = FAMILIES[family]
    tokenizer = word_tokenizer(gemma=family == "gemma3")
    overrides = {key: tokenizer.convert_tokens_to_ids(image_token)}
    if family == "gemma3":  # mlx-vlm reads the image's token count from text_config (default 256)
        # ... and the local / global layers from sliding_window_pattern
        overrides["text_config"] = {**VISION_CONFIGS["gemma3"]["text_config"], "mm_tokens_per_image": 4,
                                    "sliding_window_pattern": 2,
                                    "layer_types": ["sliding_attention", "full_attention"]}
    hf = make_vision_model(family, folder, **overrides)
    tokenizer.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(settings))
    hub_layout(folder, family)
    config = json.loads((folder / "config.json").read_text())
    if family in ("idefics3", "smolvlm"):  # the hub's configs carry rope_theta, which mlx-vlm reads
        config["text_config"]["rope_theta"] = config["text_config"]["rope_parameters"]["rope_theta"]
    if family == "gemma3":  # mlx-vlm scales the image features by a top-level hidden_size
        config["hidden_size"] = config["text_config"]["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    return hf


# -- logits ---------------------------------------------------------------------------


def prompt_inputs(folder: Path, family: str):
    """The test prompt's token ids and pixel values (n_views, C, H, W), by our processor."""
    from mlx_tfm import load

    _, processor = load(folder)
    return processor.prepare(PROMPTS[family], two_images()[:1])


def our_logits(folder: Path, ids: list, pixels: np.ndarray) -> np.ndarray:
    from mlx_tfm import load

    model, _ = load(folder)
    features = model.encode_images(mx.array(pixels))
    return np.array(model(mx.array([ids]), image_features=features)[0])


def mlx_vlm_logits(folder: Path, family: str, ids: list, pixels: np.ndarray) -> np.ndarray:
    """mlx-vlm's model over the same ids and pixels (Idefics3, SmolVLM: one row of views).
    Fed the same inputs, not mlx-vlm's own preprocessing: transformers 5 changed the
    processors' arguments under it (its LLaVA processing fails here)."""
    from mlx_vlm.utils import load

    model, _ = load(str(folder))
    values = mx.array(pixels)[None] if family in ("idefics3", "smolvlm") else mx.array(pixels)
    if family == "gemma3":
        return np.array(gemma3_logits(model, mx.array([ids]), values)[0])
    return np.array(model(mx.array([ids]), values, mask=None).logits[0])


def gemma3_logits(model, ids: mx.array, pixel_values: mx.array) -> mx.array:
    """mlx-vlm's Gemma 3 embeddings (its tower, projector and placing), then its language
    model under transformers' mask: causal, and each image's tokens seeing each other.
    (The model's own call turns the (B, L) attention mask into one that is not causal.)"""
    embeddings = model.get_input_embeddings(ids, pixel_values, mx.ones(ids.shape)).inputs_embeds
    is_image = np.array(ids[0]) == model.config.image_token_index
    L = ids.shape[1]
    mask = np.tril(np.ones((L, L), bool)) | (is_image[:, None] & is_image[None, :])  # one image in the prompt
    return model.language_model(inputs=ids, inputs_embeds=embeddings, mask=mx.array(mask)[None, None]).logits


def mlx_vlm_convert(source: Path, target: Path, **options) -> Path:
    from mlx_vlm.convert import convert

    convert(str(source), str(target), **options)
    return target


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "hf"
    hf_folder(folder, request.param)
    return request.param, folder


def test_mlx_vlm_folders_load_here_with_the_same_logits(family_folder, tmp_path):
    """mlx-vlm's converted folder: our logits equal mlx-vlm's on it and ours on the
    transformers folder it came from (whose logits equal transformers', test_vision_language.py)."""
    family, source = family_folder
    theirs = mlx_vlm_convert(source, tmp_path / "mlx-vlm")
    ids, pixels = prompt_inputs(theirs, family)
    logits = our_logits(theirs, ids, pixels)
    np.testing.assert_allclose(logits, our_logits(source, ids, pixels), atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits, mlx_vlm_logits(theirs, family, ids, pixels), atol=1e-4, rtol=0)


def test_our_folders_load_in_mlx_vlm(family_folder, tmp_path):
    from mlx_tfm.convert.converter import convert

    family, source = family_folder
    convert(source, tmp_path / "ours", log=lambda *_: None)
    ids, pixels = prompt_inputs(tmp_path / "ours", family)
    np.testing.assert_allclose(mlx_vlm_logits(tmp_path / "ours", family, ids, pixels),
                               our_logits(tmp_path / "ours", ids, pixels), atol=1e-4, rtol=0)


# mlx-vlm 0.7.10 fills a tied Gemma 3 head from embed_tokens.weight alone, without its
# scales, so a quantized folder without a copy of the head (ours) fails its shape check.
MLX_VLM_CANNOT_READ_Q4 = {"gemma3"}


def test_4_bit_folders_load_both_ways(family_folder, tmp_path):
    """mlx-vlm's -q folder (the language model in 4 bits, the tower in float) here, and ours
    in mlx-vlm: the same quantized weights give the same logits."""
    from mlx_tfm.convert.converter import convert

    family, source = family_folder
    theirs = mlx_vlm_convert(source, tmp_path / "mlx-vlm-q4", quantize=True, q_group_size=32)
    ids, pixels = prompt_inputs(theirs, family)
    np.testing.assert_allclose(our_logits(theirs, ids, pixels), mlx_vlm_logits(theirs, family, ids, pixels),
                               atol=1e-4, rtol=0)
    convert(source, tmp_path / "ours-q4", quantize=True, q_group_size=32, log=lambda *_: None)
    if family in MLX_VLM_CANNOT_READ_Q4:  # a known gap, checked so that a fixed mlx-vlm shows here
        with pytest.raises(ValueError, match="lm_head.weight"):
            mlx_vlm_logits(tmp_path / "ours-q4", family, ids, pixels)
        return
    np.testing.assert_allclose(mlx_vlm_logits(tmp_path / "ours-q4", family, ids, pixels),
                               our_logits(tmp_path / "ours-q4", ids, pixels), atol=1e-4, rtol=0)


# -- Qwen3.5 and Qwen3.5-MoE: the tower takes patches with their grids --------------------

# mlx-vlm's float32 run of Qwen3.5 lands up to ~3.2e-4 from ours, which is within 4.1e-5 of
# transformers' float64 logits (tests/generation/test_qwen3_5_image_generation.py); on the
# 4-bit folders the two land within 1e-4 of each other (measured 7.3e-5)
MLX_VLM_QWEN3_5_ATOL = 5e-4


@pytest.fixture(scope="module", params=QWEN3_5_STYLES)
def qwen3_5_source(request, tmp_path_factory):
    return qwen_vl_folder(request.param, tmp_path_factory.mktemp(request.param))[0]


def qwen3_5_inputs(folder: Path) -> tuple[list[int], np.ndarray, list]:
    """The Qwen test prompt's token ids, patches and grids with the two images, by our processor."""
    from mlx_tfm import load

    _, processor = load(folder)
    ids, pixels, image_inputs = processor.prepare_inputs(QWEN_PROMPT, two_qwen_images())
    return ids, pixels, image_inputs["grid_thw"]


def our_qwen3_5_logits(folder: Path, ids: list, pixels: np.ndarray, grids) -> np.ndarray:
    from mlx_tfm import load
    from mlx_tfm.generation.images import ImageBoundModel

    model, _ = load(folder)
    features = model.encode_images(mx.array(pixels), grid_thw=grids)
    return np.array(ImageBoundModel(model, features, ids, model.rope_positions(ids, grids))(mx.array([ids]))[0])


def mlx_vlm_qwen3_5_logits(folder: Path, ids: list, pixels: np.ndarray, grids) -> np.ndarray:
    from mlx_vlm.utils import load

    model, _ = load(str(folder))
    return np.array(model(mx.array([ids]), mx.array(pixels), mask=None, image_grid_thw=mx.array(grids)).logits[0])


def test_mlx_vlm_qwen3_5_folders_load_both_ways(qwen3_5_source, tmp_path):
    """mlx-vlm's folder (its tower ``vision_tower.*``, the patch kernel channels-last) here
    with our logits on the transformers folder; ours (the tower ``model.visual.*``) in
    mlx-vlm with its logits on its own folder."""
    from mlx_tfm.convert.converter import convert

    theirs = mlx_vlm_convert(qwen3_5_source, tmp_path / "mlx-vlm")
    kernel = mx.load(str(theirs / "model.safetensors"))["vision_tower.patch_embed.proj.weight"]
    assert kernel.shape[-1] == 3  # (D, T, P, P, C)
    inputs = qwen3_5_inputs(theirs)
    logits = our_qwen3_5_logits(theirs, *inputs)
    np.testing.assert_allclose(logits, our_qwen3_5_logits(qwen3_5_source, *inputs), atol=1e-6, rtol=0)
    expected = mlx_vlm_qwen3_5_logits(theirs, *inputs)
    np.testing.assert_allclose(logits, expected, atol=MLX_VLM_QWEN3_5_ATOL, rtol=0)
    ours = convert(qwen3_5_source, tmp_path / "ours", log=lambda *_: None)
    np.testing.assert_allclose(mlx_vlm_qwen3_5_logits(ours, *inputs), expected, atol=1e-6, rtol=0)


def test_4_bit_qwen3_5_folders_load_both_ways(qwen3_5_source, tmp_path):
    """mlx-vlm's -q folder (the language model in 4 bits, the tower in float) here, and ours
    in mlx-vlm: the same quantized weights give the same logits."""
    from mlx_tfm.convert.converter import convert

    theirs = mlx_vlm_convert(qwen3_5_source, tmp_path / "mlx-vlm-q4", quantize=True, q_group_size=32)
    inputs = qwen3_5_inputs(theirs)
    logits = our_qwen3_5_logits(theirs, *inputs)
    np.testing.assert_allclose(logits, mlx_vlm_qwen3_5_logits(theirs, *inputs), atol=1e-4, rtol=0)
    ours = convert(qwen3_5_source, tmp_path / "ours-q4", quantize=True, q_group_size=32, log=lambda *_: None)
    np.testing.assert_allclose(mlx_vlm_qwen3_5_logits(ours, *inputs), our_qwen3_5_logits(ours, *inputs), atol=1e-4,
                               rtol=0)


# -- LLaVA-NeXT: mlx-vlm 0.7.10's llava_next does not pack an image's views into its grid
# (no unpadding, no newline per row), so its image logits are no reference: its tower and
# projector over the same views, and its language model over text, are ---------------------


@pytest.fixture(scope="module")
def llava_next_source(tmp_path_factory):
    from fixtures.vision_serving import llava_folder

    """(the transformers 5 folder, its copy with the hub's text_config.rope_theta, which
    mlx-vlm reads where transformers 5 writes rope_parameters)."""
    import shutil

    folder = llava_folder(tmp_path_factory.mktemp("llava_next") / "hf", "llava_next")
    hub_layout(folder, "llava")
    hub = shutil.copytree(folder, folder.parent / "hub")
    config = json.loads((hub / "config.json").read_text())
    config["text_config"]["rope_theta"] = config["text_config"]["rope_parameters"]["rope_theta"]
    (hub / "config.json").write_text(json.dumps(config))
    return folder, hub


def llava_next_views(folder: Path) -> tuple[list[int], np.ndarray, dict]:
    from mlx_tfm import load

    _, processor = load(folder)
    return processor.prepare_inputs("user: <image> and <image> assistant:", two_images())


def mlx_vlm_view_features(folder: Path, pixels: np.ndarray) -> np.ndarray:
    """mlx-vlm's tower (its feature layer, the class token dropped) and projector per view."""
    from mlx_vlm.utils import load

    model, _ = load(str(folder))
    *_, hidden_states = model.vision_tower(mx.array(pixels).transpose(0, 2, 3, 1), output_hidden_states=True)
    return np.array(model.multi_modal_projector(hidden_states[model.vision_feature_layer][:, 1:]))


def mlx_vlm_text_logits(folder: Path, ids: list[int]) -> np.ndarray:
    from mlx_vlm.utils import load

    model, _ = load(str(folder))
    return np.array(model.language_model(mx.array([ids])).logits[0])


def our_view_features(folder: Path, pixels: np.ndarray) -> np.ndarray:
    from mlx_tfm import load

    model, _ = load(folder)
    return np.array(model.multi_modal_projector(model.vision_tower(mx.array(pixels))))


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "q4"])
def test_mlx_vlm_llava_next_folders_load_both_ways(llava_next_source, tmp_path, quantize):
    """mlx-vlm's folder here: our image logits on it equal ours on the transformers folder
    (float; -q: its quantized weights give its text logits); ours in mlx-vlm: its tower and
    projector give our views' features, its language model our text logits (the converter
    restates rope_theta for it)."""
    from mlx_tfm.convert.converter import convert

    source, hub_source = llava_next_source
    options = {"quantize": True, "q_group_size": 32} if quantize else {}
    theirs = mlx_vlm_convert(hub_source, tmp_path / "mlx-vlm", **options)
    ids, pixels, inputs = llava_next_views(theirs)
    text = [i for i in ids if i != json.loads((theirs / "config.json").read_text())["image_token_index"]]
    np.testing.assert_allclose(our_view_features(theirs, pixels), mlx_vlm_view_features(theirs, pixels), atol=1e-5,
                               rtol=0)
    np.testing.assert_allclose(our_text_logits(theirs, text), mlx_vlm_text_logits(theirs, text), atol=1e-4, rtol=0)
    if not quantize:
        np.testing.assert_allclose(our_image_logits(theirs, ids, pixels, inputs),
                                   our_image_logits(source, ids, pixels, inputs), atol=1e-5, rtol=0)
    ours = convert(source, tmp_path / "ours", log=lambda *_: None, **options)
    np.testing.assert_allclose(mlx_vlm_view_features(ours, pixels), our_view_features(ours, pixels), atol=1e-5, rtol=0)
    np.testing.assert_allclose(mlx_vlm_text_logits(ours, text), our_text_logits(ours, text), atol=1e-4, rtol=0)


def our_text_logits(folder: Path, ids: list[int]) -> np.ndarray:
    from mlx_tfm import load

    model, _ = load(folder)
    return np.array(model(mx.array([ids]))[0])


def our_image_logits(folder: Path, ids: list[int], pixels: np.ndarray, inputs: dict) -> np.ndarray:
    from mlx_tfm import load

    model, _ = load(folder)
    return np.array(model(mx.array([ids]), image_features=model.encode_images(mx.array(pixels), **inputs))[0])
