"""Gemma 4 with its vision tower (model/gemma4_vision.py, families/gemma4_vision.py)
against transformers 5 on a tiny random model: image features, logits and greedy tokens of
the whole Gemma4ForConditionalGeneration for two images of different grids (the per-layer
inputs of the image tokens are the pad token's), and our cached decoding against our own
full forward."""

import mlx.core as mx
import numpy as np
import pytest
from fixtures.gemma4_vision_models import (
    GRIDS,
    IMAGE_TOKEN,
    cut_patches,
    make_gemma4_model,
)
from fixtures.image_decoding import cached_and_full_logits, greedy_with_images

from mlx_tfm.errors import UserError
from mlx_tfm.loading import load_model


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4")
    hf = make_gemma4_model(folder)
    model, _ = load_model(folder)
    return hf, model, folder


def torch_inputs(inputs: dict) -> dict:
    import torch

    return {name: torch.tensor(value) for name, value in inputs.items()}


def our_features(model, inputs: dict) -> mx.array:
    return model.encode_images(mx.array(inputs["pixel_values"]), inputs["image_position_ids"])


def prompt_ids() -> list[int]:
    ids = [2, 7]
    for rows, cols in GRIDS:
        ids += [251] + [IMAGE_TOKEN] * ((rows // 2) * (cols // 2)) + [252, 9]
    return ids + [12, 13, 40, 41]  # past the sliding window (6)


def test_image_features_match_transformers(gemma4):
    import torch

    hf, model, _ = gemma4
    inputs = cut_patches()
    with torch.no_grad():
        expected = hf.model.get_image_features(**torch_inputs(inputs)).pooler_output
    assert [len(f) for f in expected] == [6, 2]
    np.testing.assert_allclose(np.array(our_features(model, inputs)), torch.cat(expected).numpy(), atol=1e-4, rtol=0)


def test_logits_and_greedy_tokens_match_transformers(gemma4):
    import torch

    hf, model, _ = gemma4
    inputs, ids = cut_patches(), prompt_ids()
    features = our_features(model, inputs)
    hf_inputs = {"input_ids": torch.tensor([ids]), **torch_inputs(inputs)}
    with torch.no_grad():
        expected = hf(**hf_inputs).logits[0].numpy()
        hf_tokens = hf.generate(**hf_inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
    np.testing.assert_allclose(np.array(model(mx.array([ids]), image_features=features)[0]), expected, atol=1e-4,
                               rtol=0)
    assert greedy_with_images(model, ids, features, 6) == hf_tokens


def test_cached_decoding_equals_the_full_forward(gemma4):
    _, model, _ = gemma4
    features = our_features(model, cut_patches())
    ids, continuation = prompt_ids(), [7, 200, 42, 11]
    cached, full = cached_and_full_logits(model, ids, features, continuation)
    np.testing.assert_allclose(cached, full, atol=1e-4, rtol=0)


def test_pixel_values_and_positions_match_the_slow_processor():
    from fixtures.gemma4_vision_models import gemma4_image_processor
    from fixtures.vision_images import two_images

    from mlx_tfm.tokenizer.gemma4_images import (
        preprocess_gemma4_images,
        read_gemma4_processing,
    )

    reference = gemma4_image_processor()
    theirs = reference(two_images(), return_tensors="np")
    ours = preprocess_gemma4_images(two_images(), read_gemma4_processing(reference.to_dict()))
    np.testing.assert_allclose(ours["pixel_values"], theirs["pixel_values"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(ours["image_position_ids"], theirs["image_position_ids"])
    soft_tokens = [r * c for r, c in zip(ours["rows"], ours["cols"])]
    assert soft_tokens == list(theirs["num_soft_tokens_per_image"]) == [63, 66]


@pytest.fixture(scope="module")
def gemma4_folder(gemma4):
    from fixtures.gemma4_vision_models import save_processor_files

    save_processor_files(gemma4[2])
    return gemma4


PROMPT = "describe <|image|> and <|image|> picture"


def test_the_expanded_prompt_and_generate_match_transformers(gemma4_folder):
    import torch
    from fixtures.gemma4_vision_models import gemma4_image_processor, word_tokenizer
    from fixtures.vision_images import two_images

    from mlx_tfm import load
    from mlx_tfm.generation.stream import stream_generate

    hf, _, folder = gemma4_folder
    model, processor = load(folder)
    ids, _ = processor.prepare(PROMPT, two_images())
    tokenizer = word_tokenizer()
    expected = ["describe", "<|image>", *["<|image|>"] * 63, "<image|>", "and", "<|image>", *["<|image|>"] * 66,
                "<image|>", "picture"]
    assert ids == [tokenizer.bos_token_id] * (ids[0] == tokenizer.bos_token_id) + tokenizer.convert_tokens_to_ids(expected)
    pixels = gemma4_image_processor()(two_images(), return_tensors="pt")
    with torch.no_grad():
        hf_tokens = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                                image_position_ids=pixels["image_position_ids"], max_new_tokens=6, min_new_tokens=6,
                                do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    tokens = [r.token for r in stream_generate(model, processor, PROMPT, images=two_images(), max_tokens=6)]
    assert tokens == hf_tokens


def test_the_image_flag(gemma4_folder, tmp_path):
    import os
    import subprocess
    import sys

    from fixtures.vision_images import two_images

    from mlx_tfm import load
    from mlx_tfm.generation.stream import generate

    folder = gemma4_folder[2]
    for i, image in enumerate(two_images()):
        image.save(tmp_path / f"{i}.png")
    model, processor = load(folder)
    expected = generate(model, processor, PROMPT, images=two_images(), max_tokens=4)
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", "--model", str(folder), "--image",
                             str(tmp_path / "0.png"), "--image", str(tmp_path / "1.png"), "--prompt", PROMPT,
                             "--ignore-chat-template", "--max-tokens", "4", "--verbose", "false"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected.strip()


def test_an_unsupported_soft_token_budget_is_one_line():
    from mlx_tfm.tokenizer.gemma4_images import read_gemma4_processing

    with pytest.raises(UserError, match="max_soft_tokens is one of 70, 140, 280, 560, 1120, not 100"):
        read_gemma4_processing({"max_soft_tokens": 100})


def test_convert_q_keeps_the_vision_side_in_float(gemma4_folder, tmp_path):
    from fixtures.vision_images import two_images

    from mlx_tfm import load
    from mlx_tfm.convert.converter import convert
    from mlx_tfm.generation.stream import generate

    _, model, folder = gemma4_folder
    convert(folder, tmp_path / "q4", quantize=True, q_group_size=32, log=lambda *_: None)
    weights = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    vision = [n for n in weights if n.startswith(("vision_tower.", "embed_vision."))]
    assert vision and not [n for n in vision if n.endswith(".scales")]
    assert weights["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    quantized, processor = load(tmp_path / "q4")
    inputs = cut_patches()
    np.testing.assert_allclose(np.array(our_features(quantized, inputs)), np.array(our_features(model, inputs)),
                               atol=1e-5, rtol=0)
    assert isinstance(generate(quantized, processor, PROMPT, images=two_images(), max_tokens=3), str)


# -- a checkpoint with an audio tower: the tower is dropped, audio refused in one line ------

TINY_AUDIO = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[4, 4],
                  output_proj_dims=32, attention_chunk_size=4, attention_context_left=5, conv_kernel_size=3)


@pytest.fixture(scope="module")
def gemma4_with_audio(tmp_path_factory):
    from fixtures.gemma4_vision_models import save_processor_files

    folder = tmp_path_factory.mktemp("gemma4_audio")
    hf = make_gemma4_model(folder, audio_config=TINY_AUDIO)
    save_processor_files(folder)
    return hf, folder


def test_a_checkpoint_with_an_audio_tower_reads_images_and_text_as_transformers(gemma4_with_audio):
    import torch

    from mlx_tfm.weights.files import read_safetensors

    hf, folder = gemma4_with_audio
    assert any(name.startswith("model.audio_tower.") for name in read_safetensors(folder))  # there, and dropped
    model, _ = load_model(folder)
    inputs, ids = cut_patches(), prompt_ids()
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), **torch_inputs(inputs)).logits[0].numpy()
    np.testing.assert_allclose(np.array(model(mx.array([ids]), image_features=our_features(model, inputs))[0]),
                               expected, atol=1e-4, rtol=0)


def test_an_audio_file_for_the_image_flag_is_one_line(gemma4_with_audio, tmp_path):
    import os
    import subprocess
    import sys
    import wave

    _, folder = gemma4_with_audio
    with wave.open(str(tmp_path / "speech.wav"), "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(16000)
        audio.writeframes(b"\0\0" * 1600)
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", "--model", str(folder), "--image",
                             str(tmp_path / "speech.wav"), "--prompt", PROMPT.replace(" and <|image|>", ""),
                             "--ignore-chat-template", "--max-tokens", "2"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1 and "speech.wav is not an image" in result.stderr
