"""Qwen3.5 and Qwen3.5-MoE with images end to end: ``load`` a folder as the hub has it
(transformers' Qwen3_5ForConditionalGeneration, tokenizer, preprocessor_config.json), then
``generate(model, processor, prompt, images=[...])``, ``mlx-tfm generate --image`` and
``mlx-tfm convert`` (-q: the language model quantized, the tower kept in float), against
transformers in float64 on tiny random models with the two test images of different sizes."""

import copy

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.cli_runs import run_cli
from fixtures.qwen_vision_models import IMAGE, PROMPT, QWEN3_5_STYLES, hf_inputs, qwen_vl_folder, two_images

from mlx_tfm import load
from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.generation.images import bind_images, image_prompt_text
from mlx_tfm.generation.stream import generate, stream_generate
from mlx_tfm.weights.files import read_checkpoint

# float32 runs of the delta rule land about 1e-4 from the float64 logits on these random
# models (tests/families/test_hybrid_families.py); a wrong position or image is ~0.1 off
DELTA_RULE_ATOL = 1e-4
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module", params=QWEN3_5_STYLES)
def qwen3_5_folder(request, tmp_path_factory):
    """(folder, transformers' model in float64, transformers' processor)."""
    folder, hf_model, reference = qwen_vl_folder(request.param, tmp_path_factory.mktemp(request.param))
    if request.param == "qwen3_5_moe":
        hf_model.set_experts_implementation("eager")  # the grouped products have no float64
    return folder, copy.deepcopy(hf_model).double(), reference


def float64_inputs(reference, answer: list[int] = ()) -> dict:
    """transformers' processor's inputs, the pixels in float64, ``answer`` after the prompt."""
    inputs = hf_inputs(reference)
    inputs["pixel_values"] = inputs["pixel_values"].double()
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([list(answer)], dtype=torch.long)], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == reference.image_token_id).int()
    return inputs


def test_prompt_logits_and_greedy_tokens_match_transformers(qwen3_5_folder):
    folder, hf_model, reference = qwen3_5_folder
    model, processor = load(folder)
    inputs = float64_inputs(reference)
    bound, ids = bind_images(model, processor, PROMPT, two_images())
    assert ids == inputs["input_ids"][0].tolist()
    grids = inputs["image_grid_thw"].tolist()
    assert grids[0] != grids[1]  # two sizes: two grids, each image its own run of positions
    with torch.no_grad():
        expected = hf_model(**inputs).logits[0].numpy()
        hf_tokens = hf_model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                      pad_token_id=0)[0, len(ids):].tolist()
    assert np.abs(expected).std() > 0.5
    ours = np.array(bound(mx.array([ids]), cache=bound.make_cache())[0])
    np.testing.assert_allclose(ours, expected, atol=DELTA_RULE_ATOL, rtol=0)
    tokens = [r.token for r in stream_generate(model, processor, PROMPT, images=two_images(), max_tokens=8)]
    assert tokens == hf_tokens


def test_cached_decoding_equals_transformers_full_forward(qwen3_5_folder):
    """The prompt prefilled in chunks of 7 (chunk edges inside each image: the delta rule's
    state and the convolution's carried across them), then one token at a time: the
    logits of transformers' one pass over prompt + answer."""
    folder, hf_model, reference = qwen3_5_folder
    model, processor = load(folder)
    answer = [40, 41, 42, 43, 44]
    bound, ids = bind_images(model, processor, PROMPT, two_images())
    with torch.no_grad():
        expected = hf_model(**float64_inputs(reference, answer)).logits[0].numpy()
    cache, pieces = bound.make_cache(), []
    for start in range(0, len(ids), 7):
        pieces.append(np.array(bound(mx.array([ids[start:start + 7]]), cache=cache)[0]))
    for token in answer:
        pieces.append(np.array(bound(mx.array([[token]]), cache=cache)[0]))
    np.testing.assert_allclose(np.concatenate(pieces), expected, atol=DELTA_RULE_ATOL, rtol=0)


def test_the_image_flag(qwen3_5_folder, tmp_path):
    folder = qwen3_5_folder[0]
    paths = [tmp_path / "0.png", tmp_path / "1.png"]
    for image, path in zip(two_images(), paths):
        image.save(path)
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    result = run_cli("generate", "--model", str(folder), "--image", str(paths[0]), "--image", str(paths[1]),
                     "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "4", "--verbose", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_convert_quantizes_the_language_model_and_keeps_the_tower(qwen3_5_folder, tmp_path):
    """``mlx-tfm convert -q``: the language model in 4 bits, the tower in float as
    transformers names it (``model.visual.*``, its Conv3d kernel); then ``generate --image``
    through the chat template on the converted folder. A plain conversion generates as
    the source folder does."""
    folder = qwen3_5_folder[0]
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    plain = convert(folder, tmp_path / "plain", **QUIET)
    assert (plain / "preprocessor_config.json").is_file()
    assert generate(*load(plain), PROMPT, images=two_images(), max_tokens=4) == expected
    converted = run_cli("convert", "--hf-path", str(folder), "--mlx-path", str(tmp_path / "q4"), "-q",
                        "--q-group-size", "32")
    assert converted.returncode == 0, converted.stderr
    _, weights = read_checkpoint(tmp_path / "q4")
    assert "language_model.model.layers.0.linear_attn.in_proj_qkv.scales" in weights
    assert "language_model.model.layers.3.self_attn.q_proj.scales" in weights
    tower = {name: w for name, w in weights.items() if name.startswith("model.visual.")}
    assert tower and not any(name.endswith(".scales") for name in tower)
    assert tower["model.visual.patch_embed.proj.weight"].ndim == 5  # transformers' Conv3d kernel, on disk
    assert {w.dtype for w in tower.values()} == {weights["language_model.model.norm.weight"].dtype}
    text = image_prompt_text(model, processor, "Describe this picture.", 2)
    assert text.count(IMAGE) == 2
    expected = generate(*load(tmp_path / "q4"), text, images=two_images(), max_tokens=4)
    paths = [tmp_path / "0.png", tmp_path / "1.png"]
    for image, path in zip(two_images(), paths):
        image.save(path)
    result = run_cli("generate", "--model", str(tmp_path / "q4"), "--image", str(paths[0]), "--image", str(paths[1]),
                     "--prompt", "Describe this picture.", "--max-tokens", "4", "--verbose", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_a_bfloat16_conversion_keeps_the_tower_in_16_bits_and_quantize_vision_quantizes_it(qwen3_5_folder, tmp_path):
    """As the hub's bfloat16 checkpoints convert: -q leaves the tower in bfloat16;
    --quantize-vision quantizes its blocks and merger too (the Conv3d kernel stays whole)."""
    folder = qwen3_5_folder[0]
    half = convert(folder, tmp_path / "bf16-q4", quantize=True, q_group_size=32, dtype="bfloat16", **QUIET)
    _, weights = read_checkpoint(half)
    tower = {name: w for name, w in weights.items() if name.startswith("model.visual.")}
    assert {w.dtype for w in tower.values()} == {mx.bfloat16} and not any(n.endswith(".scales") for n in tower)
    assert isinstance(generate(*load(half), PROMPT, images=two_images(), max_tokens=2), str)
    whole = convert(folder, tmp_path / "qv", quantize=True, q_group_size=32, quantize_vision=True, **QUIET)
    _, weights = read_checkpoint(whole)
    assert "model.visual.blocks.0.attn.qkv.scales" in weights and "model.visual.merger.linear_fc1.scales" in weights
    assert weights["model.visual.patch_embed.proj.weight"].ndim == 5
    assert isinstance(generate(*load(whole), PROMPT, images=two_images(), max_tokens=2), str)


def test_images_for_a_folder_that_cannot_read_them_are_one_line(qwen3_5_folder, tmp_path):
    """A folder as mlx-lm's conversion writes it (no tower, no vision_config: loaded by
    tests/families/test_hybrid_families.py) reads text only; a folder without
    preprocessor_config.json cannot prepare images."""
    import json
    import shutil

    folder = qwen3_5_folder[0]
    text_only = convert(folder, tmp_path / "text-only", **QUIET)
    config = json.loads((text_only / "config.json").read_text())
    (text_only / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "vision_config"}))
    weights = mx.load(str(text_only / "model.safetensors"))
    mx.save_safetensors(str(text_only / "model.safetensors"),
                        {name: w for name, w in weights.items() if not name.startswith("model.visual.")})
    with pytest.raises(UserError, match=r"^this model \(qwen3_5(_moe)?\) reads text only: it takes no images$"):
        generate(*load(text_only), PROMPT, images=two_images(), max_tokens=1)
    shutil.copytree(folder, tmp_path / "bare", ignore=shutil.ignore_patterns("preprocessor_config.json"))
    with pytest.raises(UserError, match="has no preprocessor_config.json, so its images cannot be prepared"):
        generate(*load(tmp_path / "bare"), PROMPT, images=two_images(), max_tokens=1)
