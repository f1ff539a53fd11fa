"""Qwen2-VL and Qwen2.5-VL end to end: ``load`` a folder as the hub has it, then
``generate(model, processor, prompt, images=[...])``, ``mlx-tfm generate --image`` and
``mlx-tfm convert`` (-q keeps the tower in float unless --quantize-vision), against
transformers' processor and ``*ForConditionalGeneration`` on tiny random models with the
two test images of different sizes."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures.cli_runs import run_cli
from fixtures.qwen_vision_models import CHAT_TEMPLATE, IMAGE, PROMPT, hf_inputs, qwen_vl_folder, two_images

from mlx_tfm import load
from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.generation.images import bind_images, image_prompt_text
from mlx_tfm.generation.stream import generate, stream_generate
from mlx_tfm.weights.files import read_checkpoint

STYLES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
@pytest.fixture(scope="module", params=STYLES)
def qwen_folder(request, tmp_path_factory):
    return qwen_vl_folder(request.param, tmp_path_factory.mktemp(request.param))


def test_prompt_logits_and_greedy_tokens_match_transformers(qwen_folder):
    folder, hf_model, reference = qwen_folder
    model, processor = load(folder)
    inputs = hf_inputs(reference)
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
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    tokens = [r.token for r in stream_generate(model, processor, PROMPT, images=two_images(), max_tokens=8)]
    assert tokens == hf_tokens


def test_cached_decoding_equals_transformers_full_forward(qwen_folder):
    """The prompt prefilled in chunks of 7 (a chunk boundary inside each image), then one
    token at a time: the logits of transformers' one pass over prompt + answer, so the
    decoding positions run rope_delta behind the count as theirs do."""
    folder, hf_model, reference = qwen_folder
    model, processor = load(folder)
    answer = [40, 41, 42, 43, 44]
    bound, ids = bind_images(model, processor, PROMPT, two_images())
    inputs = hf_inputs(reference)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([answer])], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == reference.image_token_id).int()
    with torch.no_grad():
        expected = hf_model(**inputs).logits[0].numpy()
    cache, pieces = bound.make_cache(), []
    for start in range(0, len(ids), 7):
        pieces.append(np.array(bound(mx.array([ids[start:start + 7]]), cache=cache)[0]))
    for token in answer:
        pieces.append(np.array(bound(mx.array([[token]]), cache=cache)[0]))
    np.testing.assert_allclose(np.concatenate(pieces), expected[:len(ids) + len(answer)], atol=1e-4, rtol=0)
    whole = np.array(bound(mx.array([ids + answer])))[0]  # no cache: the prompt and the answer at once
    np.testing.assert_allclose(whole, expected, atol=1e-4, rtol=0)


def test_the_image_flag(qwen_folder, tmp_path):
    folder = qwen_folder[0]
    paths = [tmp_path / "0.png", tmp_path / "1.png"]
    for image, path in zip(two_images(), paths):
        image.save(path)
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    result = run_cli("generate", "--model", str(folder), "--image", str(paths[0]), "--image", str(paths[1]),
                     "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "4", "--verbose", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_the_chat_template_writes_the_images_and_the_cli_converts(qwen_folder, tmp_path):
    """The images as content parts of the user message, rendered as transformers renders
    them; then ``mlx-tfm convert -q`` and ``generate --image`` through that template."""
    folder, _, reference = qwen_folder
    model, processor = load(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": "Describe this picture."}]}]
    text = image_prompt_text(model, processor, "Describe this picture.", 2)
    assert text == reference.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE,
                                                           add_generation_prompt=True, tokenize=False)
    assert text.count(IMAGE) == 2
    converted = run_cli("convert", "--hf-path", str(folder), "--mlx-path", str(tmp_path / "q4"), "-q",
                        "--q-group-size", "32")
    assert converted.returncode == 0, converted.stderr
    paths = [tmp_path / "0.png", tmp_path / "1.png"]
    for image, path in zip(two_images(), paths):
        image.save(path)
    expected = generate(*load(tmp_path / "q4"), text, images=two_images(), max_tokens=4)
    result = run_cli("generate", "--model", str(tmp_path / "q4"), "--image", str(paths[0]), "--image", str(paths[1]),
                     "--prompt", "Describe this picture.", "--max-tokens", "4", "--verbose", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_images_without_placeholders_go_first(qwen_folder):
    folder, _, reference = qwen_folder
    _, processor = load(folder)
    ids, _ = processor.prepare("Describe them.", two_images())
    assert ids == hf_inputs(reference, f"{IMAGE}{IMAGE}Describe them.")["input_ids"][0].tolist()
    with pytest.raises(UserError, match="1 image placeholders for 2 images"):
        processor.prepare(f"{IMAGE} only one", two_images())


def test_convert_quantizes_the_language_model_and_keeps_the_tower(qwen_folder, tmp_path):
    folder, hf_model, reference = qwen_folder
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    plain = convert(folder, tmp_path / "plain", log=lambda *_: None)
    assert (plain / "preprocessor_config.json").is_file()
    assert generate(*load(plain), PROMPT, images=two_images(), max_tokens=4) == expected
    quantized = convert(folder, tmp_path / "q", quantize=True, q_group_size=32, log=lambda *_: None)
    _, weights = read_checkpoint(quantized)
    assert "language_model.model.layers.0.mlp.up_proj.scales" in weights
    assert not any(name.startswith("visual.") and name.endswith(".scales") for name in weights)
    assert weights["visual.patch_embed.proj.weight"].ndim == 5  # transformers' Conv3d kernel, on disk
    assert isinstance(generate(*load(quantized), PROMPT, images=two_images(), max_tokens=4), str)
    whole = convert(folder, tmp_path / "qv", quantize=True, q_group_size=32, quantize_vision=True,
                    log=lambda *_: None)
    _, weights = read_checkpoint(whole)
    assert "visual.blocks.0.attn.qkv.scales" in weights
    assert any(name.startswith("visual.merger.") and name.endswith(".scales") for name in weights)
    assert isinstance(generate(*load(whole), PROMPT, images=two_images(), max_tokens=4), str)
