"""Images through generation (mlx_tfm/generation/images.py): the Python API
``generate(model, processor, prompt, images=[...])`` and ``mlx-tfm generate --image``,
against transformers' processor and generate on a tiny random LLaVA; and the one-line
refusals."""

import json
import os
import subprocess
import sys

import pytest
from fixtures.vision_images import two_images
from fixtures.vision_models import make_vision_model
from fixtures.vision_processors import processor as hf_processor

from mlx_tfm import load
from mlx_tfm.errors import UserError
from mlx_tfm.generation.stream import generate, stream_generate

PROMPT = "user: describe <image> and <image> assistant:"


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    """A tiny LLaVA whose <image> token is the word tokenizer's, with its processor files."""
    folder = tmp_path_factory.mktemp("llava")
    reference = hf_processor("llava", tokens_per_view=0)
    image_id = reference.tokenizer.convert_tokens_to_ids("<image>")
    hf = make_vision_model("llava", folder, image_token_index=image_id)
    reference.tokenizer.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(
        {"patch_size": 8, "num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"}))
    return folder, hf, reference


def test_generate_with_images_matches_transformers(llava_folder, tmp_path):
    import torch

    folder, hf, reference = llava_folder
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
    assert isinstance(generate(model, processor, PROMPT, images=two_images(), max_tokens=2), str)


def test_an_image_for_a_text_only_model_is_one_line(stories_hf):
    model, tokenizer = load(stories_hf)
    with pytest.raises(UserError, match="reads text only: it takes no images") as error:
        generate(model, tokenizer, "Once", images=two_images()[:1], max_tokens=2)
    assert "\n" not in str(error.value)


def test_placeholders_unlike_the_images_are_one_line(llava_folder):
    model, processor = load(llava_folder[0])
    with pytest.raises(UserError, match="1 <image> placeholder"):
        generate(model, processor, "describe <image>", images=two_images(), max_tokens=2)


def run_generate(*args):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", *args], capture_output=True, text=True,
                          timeout=300, env=environment)


def test_the_image_flag(llava_folder, tmp_path):
    folder, _, _ = llava_folder
    for i, image in enumerate(two_images()):
        image.save(tmp_path / f"{i}.png")
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    result = run_generate("--model", str(folder), "--image", str(tmp_path / "0.png"), "--image", str(tmp_path / "1.png"),
                          "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "4", "--verbose", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()
    (tmp_path / "bad.png").write_text("not an image")
    bad = run_generate("--model", str(folder), "--image", str(tmp_path / "bad.png"), "--prompt", "describe",
                       "--ignore-chat-template", "--max-tokens", "2")
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1
    assert "is not an image" in bad.stderr


def test_a_prefill_in_chunks_gives_each_chunk_its_images_features(llava_folder):
    """ImageBoundModel counts the image tokens before each chunk: a prompt fed 7 tokens at a
    time gives the logits of one pass over it."""
    import mlx.core as mx
    import numpy as np

    from mlx_tfm.generation.images import bind_images

    model, processor = load(llava_folder[0])
    bound, ids = bind_images(model, processor, PROMPT, two_images())
    whole = np.array(bound(mx.array([ids]), cache=bound.make_cache())[0])
    cache, pieces = bound.make_cache(), []
    for start in range(0, len(ids), 7):
        pieces.append(np.array(bound(mx.array([ids[start:start + 7]]), cache=cache)[0]))
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-4, rtol=0)


def test_too_many_images_for_the_context_is_one_line(llava_folder):
    """The tiny LLaVA's context is 1024 positions; 70 images of 16 tokens do not fit."""
    model, processor = load(llava_folder[0])
    with pytest.raises(UserError, match="70 image.s. takes 11[0-9][0-9] tokens and the context holds 1024"):
        generate(model, processor, "describe", images=two_images()[:1] * 70, max_tokens=2)
