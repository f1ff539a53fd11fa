"""LLaVA-NeXT through generation: ``generate(..., images=[...])`` against transformers'
LlavaNextProcessor and generate on a tiny random model (the two test images fit different
grids), a prefill in chunks, and ``mlx-tfm generate --image`` on a converted folder
(float and ``-q``, the processor files carried)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.cli_runs import run_cli
from fixtures.vision_images import two_images
from fixtures.vision_models import make_vision_model
from fixtures.vision_processors import processor as hf_processor

from mlx_tfm import load
from mlx_tfm.generation.images import bind_images
from mlx_tfm.generation.stream import generate, stream_generate

PROMPT = "user: describe <image> and <image> assistant:"


@pytest.fixture(scope="module")
def llava_next_folder(tmp_path_factory):
    """A tiny LLaVA-NeXT whose <image> token is the word tokenizer's, with its processor files."""
    folder = tmp_path_factory.mktemp("llava_next")
    reference = hf_processor("llava_next", tokens_per_view=0)
    image_id = reference.tokenizer.convert_tokens_to_ids("<image>")
    hf = make_vision_model("llava_next", folder, image_token_index=image_id)
    reference.tokenizer.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(
        {"patch_size": 8, "num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"}))
    return folder, hf, reference


def test_generate_with_images_matches_transformers(llava_next_folder, tmp_path):
    import torch

    folder, hf, reference = llava_next_folder
    for i, image in enumerate(two_images()):
        image.save(tmp_path / f"{i}.png")
    model, processor = load(folder)
    tokens = [r.token for r in stream_generate(model, processor, PROMPT, images=[tmp_path / "0.png", tmp_path / "1.png"],
                                               max_tokens=6)]
    inputs = reference(text=PROMPT, images=two_images(), return_tensors="pt")
    ours, _ = processor.prepare(PROMPT, two_images())
    assert ours == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = hf.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert tokens == expected[0, len(ours):].tolist()


def test_a_prefill_in_chunks_gives_each_chunk_its_images_features(llava_next_folder):
    model, processor = load(llava_next_folder[0])
    bound, ids = bind_images(model, processor, PROMPT, two_images())
    whole = np.array(bound(mx.array([ids]), cache=bound.make_cache())[0])
    cache, pieces = bound.make_cache(), []
    for start in range(0, len(ids), 7):
        pieces.append(np.array(bound(mx.array([ids[start:start + 7]]), cache=cache)[0]))
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "q4"])
def test_the_image_flag_on_a_converted_folder(llava_next_folder, tmp_path, quantize):
    from mlx_tfm.convert.converter import convert

    folder, _, _ = llava_next_folder
    converted = tmp_path / "converted"
    convert(folder, converted, quantize=quantize, q_group_size=32, log=lambda *_: None)
    assert (converted / "preprocessor_config.json").is_file() and (converted / "processor_config.json").is_file()
    for i, image in enumerate(two_images()):
        image.save(tmp_path / f"{i}.png")
    model, processor = load(converted)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    if not quantize:  # the float folder decodes as the source folder does
        assert expected == generate(*load(folder), PROMPT, images=two_images(), max_tokens=4)
    result = run_cli("generate", "--model", str(converted), "--image", str(tmp_path / "0.png"), "--image",
                     str(tmp_path / "1.png"), "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "4",
                     "--verbose", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()
