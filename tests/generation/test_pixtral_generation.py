"""Mistral 3 images through loading, generation and conversion: ``load`` +
``generate(..., images=[...])``, ``mlx-tfm generate --image`` and ``mlx-tfm convert -q``
on a tiny random Mistral 3 folder, against transformers' generate."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from fixtures.pixtral_models import (
    hf_pixtral_inputs,
    make_pixtral_model,
    save_processor_files,
)
from fixtures.vision_images import two_images

from mlx_tfm import load
from mlx_tfm.convert.converter import convert
from mlx_tfm.generation.images import bind_images
from mlx_tfm.generation.stream import generate, stream_generate

PROMPT = "[INST] describe [IMG] and [IMG] [/INST]"
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def mistral3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral3")
    hf = make_pixtral_model(folder)
    save_processor_files(folder)
    return folder, hf


def hf_greedy(hf, ids: list[int], n: int, family: str = "mistral3") -> list[int]:
    import torch

    inputs = hf_pixtral_inputs(two_images(), family)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=torch.tensor(inputs["pixel_values"]),
                          image_sizes=torch.tensor(inputs["image_sizes"]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_generate_with_images_matches_transformers(mistral3_folder, tmp_path):
    folder, hf = mistral3_folder
    for i, image in enumerate(two_images()):
        image.save(tmp_path / f"{i}.png")
    model, processor = load(folder)
    ids, _ = processor.prepare(PROMPT, two_images())
    tokens = [r.token for r in stream_generate(model, processor, PROMPT, images=[tmp_path / "0.png", tmp_path / "1.png"],
                                               max_tokens=6)]
    assert tokens == hf_greedy(hf, ids, 6)


def test_a_prefill_in_chunks_gives_each_chunk_its_images_features(mistral3_folder):
    model, processor = load(mistral3_folder[0])
    bound, ids = bind_images(model, processor, PROMPT, two_images())
    whole = np.array(bound(mx.array([ids]), cache=bound.make_cache())[0])
    cache, pieces = bound.make_cache(), []
    for start in range(0, len(ids), 7):
        pieces.append(np.array(bound(mx.array([ids[start:start + 7]]), cache=cache)[0]))
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-4, rtol=0)


def run_cli(*args):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "mlx_tfm", *args], capture_output=True, text=True, timeout=300,
                          env=environment)


def test_the_image_flag(mistral3_folder, tmp_path):
    folder, _ = mistral3_folder
    for i, image in enumerate(two_images()):
        image.save(tmp_path / f"{i}.png")
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    result = run_cli("generate", "--model", str(folder), "--image", str(tmp_path / "0.png"), "--image",
                     str(tmp_path / "1.png"), "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "4",
                     "--verbose", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_convert_q_keeps_the_vision_side_in_float(mistral3_folder, tmp_path):
    folder, _ = mistral3_folder
    result = run_cli("convert", "--hf-path", str(folder), "--mlx-path", str(tmp_path / "q4"), "-q",
                     "--q-group-size", "32")
    assert result.returncode == 0, result.stderr
    weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    vision = [n for n in weights if n.startswith(("vision_tower.", "multi_modal_projector."))]
    text = [n for n in weights if n.endswith("q_proj.weight") and n not in vision]
    assert vision and not [n for n in vision if n.endswith(".scales")]
    assert text and all(weights[n].dtype == mx.uint32 for n in text)
    model, processor = load(tmp_path / "q4")
    _, pixels, image_inputs = processor.prepare_inputs(PROMPT, two_images())
    float_model, _ = load(folder)
    np.testing.assert_allclose(np.array(model.encode_images(mx.array(pixels), **image_inputs)),
                               np.array(float_model.encode_images(mx.array(pixels), **image_inputs)), atol=1e-5)
    assert isinstance(generate(model, processor, PROMPT, images=two_images(), max_tokens=3), str)


def test_the_converted_float_folder_generates_as_transformers(mistral3_folder, tmp_path):
    folder, hf = mistral3_folder
    convert(folder, tmp_path / "mlx", **QUIET)
    model, processor = load(tmp_path / "mlx")
    ids, _ = processor.prepare(PROMPT, two_images())
    tokens = [r.token for r in stream_generate(model, processor, PROMPT, images=two_images(), max_tokens=6)]
    assert tokens == hf_greedy(hf, ids, 6)


def test_pixtral_12b_generates_as_transformers(tmp_path):
    """A llava folder with the Pixtral tower: its processor reads Pixtral's images and grid."""
    hf = make_pixtral_model(tmp_path / "llava", "llava", seed=1)  # a seed whose 6 greedy tokens hold no eos
    save_processor_files(tmp_path / "llava", "llava")
    model, processor = load(tmp_path / "llava")
    ids, _ = processor.prepare(PROMPT, two_images())
    assert ids.count(4) == 6 - 1 + 8 - 1 and ids.count(5) == 2  # [IMG_BREAK] after all rows but the last
    tokens = [r.token for r in stream_generate(model, processor, PROMPT, images=two_images(), max_tokens=6)]
    assert tokens == hf_greedy(hf, ids, 6, "llava")
