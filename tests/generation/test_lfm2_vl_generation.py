"""LFM2-VL images end to end on a tiny random transformers Lfm2VlForConditionalGeneration
saved with its processor folder: ``load`` + ``generate(..., images=[...])`` (our
preprocessing) against transformers' model fed transformers' processor's inputs (run with
the torchvision stand-in, fixtures/lfm2_vl_processors.py) for an image cut into tiles and
one that is a single view: the prompt's ids, full logits, greedy tokens; a prefill in
chunks; ``mlx-tfm generate --image``; a ``convert -q`` folder keeps its processor."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from fixtures.lfm2_vl_models import make_lfm2_vl_model
from fixtures.lfm2_vl_processors import image_token_id, reference_inputs, save_processor_files
from fixtures.vision_images import drawn_image, two_images

from mlx_tfm import load
from mlx_tfm.generation.images import bind_images
from mlx_tfm.generation.stream import generate, stream_generate

PROMPT = "user: describe <image> and <image> assistant:"


def images() -> list:
    """70x52 (2x3 tiles and a thumbnail) and 30x20 (one view of 4x8 patches)."""
    return [two_images()[0], drawn_image(30, 20, seed=3)]


@pytest.fixture(scope="module")
def lfm2_vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lfm2_vl")
    hf = make_lfm2_vl_model(folder, image_token_id=image_token_id())
    save_processor_files(folder)
    reference = reference_inputs(folder, PROMPT, images(), tmp_path_factory.mktemp("reference"))
    return folder, hf, reference


def hf_inputs(reference: dict) -> dict:
    import torch

    return {"input_ids": torch.tensor(reference["input_ids"][None]),
            **{name: torch.tensor(reference[name]) for name in ("pixel_values", "pixel_attention_mask",
                                                                "spatial_shapes")}}


def test_logits_on_preprocessed_images_match_transformers(lfm2_vl):
    import torch

    folder, hf, reference = lfm2_vl
    model, processor = load(folder)
    bound, ids = bind_images(model, processor, PROMPT, images())
    assert ids == reference["input_ids"].tolist()
    with torch.no_grad():
        expected = hf(**hf_inputs(reference)).logits[0].numpy()
    np.testing.assert_allclose(np.array(bound(mx.array([ids]))[0]), expected, atol=1e-4, rtol=0)


def test_greedy_tokens_match_transformers(lfm2_vl):
    import torch

    folder, hf, reference = lfm2_vl
    model, processor = load(folder)
    with torch.no_grad():
        out = hf.generate(**hf_inputs(reference), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = out[0, len(reference["input_ids"]):].tolist()
    assert [r.token for r in stream_generate(model, processor, PROMPT, images=images(), max_tokens=6)] == expected


def test_a_prefill_in_chunks_gives_each_chunk_its_images_features(lfm2_vl):
    model, processor = load(lfm2_vl[0])
    bound, ids = bind_images(model, processor, PROMPT, images())
    whole = np.array(bound(mx.array([ids]), cache=bound.make_cache())[0])
    cache, pieces = bound.make_cache(), []
    for start in range(0, len(ids), 23):
        pieces.append(np.array(bound(mx.array([ids[start:start + 23]]), cache=cache)[0]))
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-4, rtol=0)


def test_the_image_flag(lfm2_vl, tmp_path):
    folder = lfm2_vl[0]
    paths = [tmp_path / f"{i}.png" for i in range(2)]
    for image, path in zip(images(), paths):
        image.save(path)
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=images(), max_tokens=4)
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", "--model", str(folder), "--image",
                             str(paths[0]), "--image", str(paths[1]), "--prompt", PROMPT, "--ignore-chat-template",
                             "--max-tokens", "4", "--verbose", "false"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip() and expected.strip()


def test_a_converted_q_folder_keeps_its_processor(lfm2_vl, tmp_path):
    from mlx_tfm.convert.converter import convert

    folder = lfm2_vl[0]
    convert(folder, tmp_path / "q4", quantize=True, q_group_size=32, log=lambda *_: None)
    model, processor = load(tmp_path / "q4")
    _, float_processor = load(folder)
    ids, pixels, tower_inputs = processor.prepare_inputs(PROMPT, images())
    float_ids, float_pixels, _ = float_processor.prepare_inputs(PROMPT, images())
    assert ids == float_ids and np.array_equal(pixels, float_pixels)
    assert tower_inputs["spatial_shapes"].tolist() == lfm2_vl[2]["spatial_shapes"].tolist()
    assert isinstance(generate(model, processor, PROMPT, images=images(), max_tokens=3), str)
