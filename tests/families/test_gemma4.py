"""Gemma 4's mechanisms beyond the parity cases (TINY_CONFIGS "gemma4*"): cached decoding
past the sliding window against transformers, the KV-shared layers keeping no cache, the
proportional RoPE against its formula, the batching engine, and the configs we refuse."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import TINY_CONFIGS, hf_logits, make_hf_model

from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.loading import load, load_model
from mlx_tfm.model.kv_sharing import kv_sources
from mlx_tfm.model.positions import RoPE
from mlx_tfm.model.transformer import Model

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]  # past the window of 6
FOLLOW = [7, 99, 180, 23, 61, 4, 230, 15, 88, 140]
GEMMA4_CASES = ("gemma4_text", "gemma4_text_k_eq_v", "gemma4_text_moe", "gemma4")


def decoded_logits(model, cache) -> np.ndarray:
    """The prompt prefilled in two chunks, then FOLLOW one token at a time: logits at every
    position, (len(PROMPT) + len(FOLLOW), vocab)."""
    rows = [model(mx.array([PROMPT[:9]]), cache=cache)[0], model(mx.array([PROMPT[9:]]), cache=cache)[0]]
    rows += [model(mx.array([[token]]), cache=cache)[0] for token in FOLLOW]
    return np.array(mx.concatenate(rows).astype(mx.float32))


def with_layer_scalars(hf, folder):
    """The blocks' learned output scalars are buffers, which make_hf_model leaves at 1:
    set each to its own value and save again."""
    import torch

    with torch.no_grad():
        scalars = [buffer for name, buffer in hf.named_buffers() if name.endswith("layer_scalar")]
        for i, buffer in enumerate(scalars):
            buffer.fill_(0.6 + 0.2 * i)
    assert scalars
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("name", GEMMA4_CASES)
def test_cached_decoding_past_the_window_matches_transformers(name, tmp_path):
    hf = with_layer_scalars(make_hf_model(name, tmp_path / "hf"), tmp_path / "hf")
    model, _ = load_model(tmp_path / "hf")
    reference = hf_logits(hf, PROMPT + FOLLOW)
    np.testing.assert_allclose(np.array(model(mx.array([PROMPT + FOLLOW]))[0]), reference, atol=1e-4, rtol=0)
    cache = model.make_cache()
    np.testing.assert_allclose(decoded_logits(model, cache), reference, atol=1e-4, rtol=0)
    assert {c.offset for c in cache} == {len(PROMPT + FOLLOW)}


def test_kv_shared_layers_keep_no_cache_and_read_their_sources():
    """Five layers, the last two shared: layer 3 (sliding) reads layer 2, layer 4 (full)
    reads layer 1; only layers 0-2 have caches, and the shared layers have no k/v weights."""
    args = model_args_from_config({**TINY_CONFIGS["gemma4_text"], "model_type": "gemma4_text"})
    assert kv_sources(args) == [0, 1, 2, 2, 1]
    model = Model(args)
    assert len(model.make_cache()) == 3
    assert "k_proj" not in model.layers[3].self_attn and "v_proj" not in model.layers[4].self_attn
    assert model.layers[1].self_attn.head_dim == 32 and model.layers[0].self_attn.head_dim == 16


def test_keys_as_values_on_the_full_layers_only():
    args = model_args_from_config({**TINY_CONFIGS["gemma4_text_k_eq_v"]})
    model = Model(args)
    full, sliding = model.layers[1].self_attn, model.layers[0].self_attn
    assert "v_proj" not in full and full.n_kv_heads == 1 and full.k_proj.weight.shape == (32, 64)
    assert "v_proj" in sliding and sliding.n_kv_heads == 2
    assert model.layers[3].mlp.up_proj.weight.shape == (256, 64)  # double-wide on a shared layer


def test_proportional_rope_turns_only_the_first_pairs_at_full_head_frequencies():
    """Independent formula: pair (i, i + D/2) turns by pos * base^(-2i/D) for the first
    partial_rotary_factor of the D/2 pairs; the other pairs keep their values."""
    D, base, position = 16, 100.0, 5
    rope = RoPE(D, False, base, {"rope_type": "proportional", "partial_rotary_factor": 0.25}, 128)
    x = np.random.default_rng(0).normal(size=(1, 1, 1, D)).astype(np.float32)
    out = np.array(rope(mx.array(x), position))[0, 0, 0]
    expected = x[0, 0, 0].copy()
    for i in range(D // 2 // 4):  # 2 of the 8 pairs
        angle = position * base ** (-2 * i / D)
        a, b = x[0, 0, 0, i], x[0, 0, 0, i + D // 2]
        expected[i], expected[i + D // 2] = a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_batched_engine_matches_one_prompt_at_a_time(stories_hf):
    """Rows of different lengths in one batch, past the window: KV sharing and per-layer
    inputs through the engine's batched caches give each prompt its own greedy tokens."""
    from mlx_tfm.engine.loop import batch_generate
    from mlx_tfm.generation.stream import stream_generate

    _, tokenizer = load(stories_hf)
    config = {**TINY_CONFIGS["gemma4_text"], "model_type": "gemma4_text", "vocab_size": 512,
              "vocab_size_per_layer_input": 512}
    mx.random.seed(0)
    model = Model(model_args_from_config(config))
    prompts = ["Once upon a time there was a little girl", "The cat", "Lily and Tom went to the park. They"]
    together = batch_generate(model, tokenizer, prompts, 12)
    alone = ["".join(r.text for r in stream_generate(model, tokenizer, p, max_tokens=12)) for p in prompts]
    assert together == alone


@pytest.mark.parametrize("keys,message", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, "top_k_experts"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"num_kv_shared_layers": 5}, "every layer KV-shared"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, "overrides a sliding layer"),
])
def test_unsupported_configs_are_refused(keys, message):
    config = {**TINY_CONFIGS["gemma4_text"], "model_type": "gemma4_text", **keys}
    with pytest.raises(UserError, match=message):
        model_args_from_config(config)


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_splitting_over_ranks_is_refused(mode):
    from mlx_tfm.distributed.sharding import check_splittable

    model = Model(model_args_from_config({**TINY_CONFIGS["gemma4_text"], "model_type": "gemma4_text"}))
    with pytest.raises(UserError, match="does not split models with KV-shared layers or per-layer inputs"):
        check_splittable(model, mode)


def test_mlx_lm_reads_transformers_defaults_for_keys_a_config_leaves_out():
    """mlx-lm's gemma4_text has its own defaults (20 KV-shared layers, a double-wide MLP,
    soft-capping at 30): the config we write restates transformers' for what is missing."""
    from transformers import Gemma4TextConfig

    from mlx_tfm.families.mlx_lm import mlx_lm_config_keys

    config = {k: v for k, v in TINY_CONFIGS["gemma4_text"].items()
              if k not in ("num_kv_shared_layers", "final_logit_softcapping")}
    keys = mlx_lm_config_keys({**config, "model_type": "gemma4_text"})
    reference = Gemma4TextConfig(**config)
    assert keys["num_kv_shared_layers"] == reference.num_kv_shared_layers == 0
    assert keys["use_double_wide_mlp"] is reference.use_double_wide_mlp is False
    assert keys["final_logit_softcapping"] is reference.final_logit_softcapping is None
    assert keys["layer_types"] == reference.layer_types and keys["global_head_dim"] == 32
