"""Sliding-window families against transformers with the window active: in the prompt
(longer than the window) and in cached decoding that runs past it (a rotating cache), and
OLMo 3 from config files in the transformers-4 style its released checkpoints use."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import TINY_CONFIGS, greedy, hf_greedy, hf_logits, make_hf_model

from mlx_tfm.loading import load_model
from mlx_tfm.model.cache import RotatingKVCache

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]  # longer than every window below
FOLLOW = [7, 99, 180, 23, 61, 4, 230, 15, 88, 140]  # decoded one at a time after the prompt
SLIDING_FAMILIES = ("gemma2", "gemma3_text", "gpt_oss", "exaone4", "ministral", "starcoder2", "mistral", "olmo3")


def cached_logits(model, prompt: list[int], follow: list[int]) -> np.ndarray:
    """Logits at every position: the prompt prefilled into the cache, then each token of
    ``follow`` decoded alone -> (len(prompt) + len(follow), vocab)."""
    cache = model.make_cache()
    rows = [model(mx.array([prompt]), cache=cache)[0]]
    rows += [model(mx.array([[token]]), cache=cache)[0] for token in follow]
    return np.array(mx.concatenate(rows).astype(mx.float32)), cache


@pytest.mark.parametrize("name", SLIDING_FAMILIES)
def test_window_active_in_prefill_and_in_decoding_past_it(name, tmp_path):
    hf = make_hf_model(name, tmp_path / "hf")
    window = TINY_CONFIGS[name]["sliding_window"]
    assert len(PROMPT) > window and len(FOLLOW) > window
    model, _ = load_model(tmp_path / "hf")
    reference = hf_logits(hf, PROMPT + FOLLOW)
    full = np.array(model(mx.array([PROMPT + FOLLOW]))[0].astype(mx.float32))
    np.testing.assert_allclose(full, reference, atol=1e-4, rtol=0)
    decoded, cache = cached_logits(model, PROMPT, FOLLOW)
    assert any(isinstance(c, RotatingKVCache) and c.max_size == window for c in cache)
    np.testing.assert_allclose(decoded, reference, atol=1e-4, rtol=0)


def transformers4_config(folder) -> dict:
    """Rewrite a saved OLMo 3 folder's config.json as the released checkpoints write it:
    ``rope_theta`` and ``rope_scaling`` (the full-attention layers') at the top, no
    ``layer_types``, no ``rope_parameters``."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    full = dict(config.pop("rope_parameters")["full_attention"])
    config.pop("layer_types")
    config["rope_theta"] = full.pop("rope_theta")
    if full.get("rope_type") != "default":
        config["rope_scaling"] = full
    path.write_text(json.dumps(config))
    return config


YARN_AS_RELEASED = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                    "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("theta", [500000.0, 10000.0])
def test_olmo3_released_config_in_transformers4_style(theta, tmp_path):
    """Olmo-3 7B/32B's RoPE: YaRN with its attention factor on the full layers, base 500000;
    and another base, which transformers 5 gives the full layers only (the sliding ones
    keep its default, 500000)."""
    from transformers import AutoModelForCausalLM

    config = {k: v for k, v in TINY_CONFIGS["olmo3"].items() if k != "rope_parameters"}
    rope = dict(rope_theta=theta, max_position_embeddings=65536, rope_scaling=YARN_AS_RELEASED)
    make_hf_model("olmo3", tmp_path / "hf", rope_parameters=None, **{**config, **rope})
    transformers4_config(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float().eval()
    model, _ = load_model(tmp_path / "hf")
    reference = hf_logits(hf, PROMPT + FOLLOW)
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT + FOLLOW]))[0]), reference, atol=1e-4, rtol=0)
    np.testing.assert_allclose(cached_logits(model, PROMPT, FOLLOW)[0], reference, atol=1e-4, rtol=0)
    assert greedy(model, PROMPT, 8) == hf_greedy(hf, PROMPT, 8)


def test_olmo3_config_without_rope_theta_takes_transformers_default(tmp_path):
    """No rope_theta in the file: transformers' Olmo3Config default base is 500000."""
    from transformers import AutoModelForCausalLM

    make_hf_model("olmo3", tmp_path / "hf", rope_parameters=None)
    transformers4_config(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    del config["rope_theta"]
    path.write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float().eval()
    model, _ = load_model(tmp_path / "hf")
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT]))[0]), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
