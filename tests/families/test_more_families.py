"""The more_decoders / more_mixtures families beyond the parity cases: config spellings
their hub checkpoints use, what they refuse, and the mechanisms they added, checked
against independent formulas and invariants."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import TINY_CONFIGS

from mlx_tfm.errors import UserError
from mlx_tfm.families import model_args_from_config
from mlx_tfm.model import Model, ModelArgs
from mlx_tfm.model.attention import query_position_scale
from mlx_tfm.model.experts import route


def tiny(name: str, **keys) -> dict:
    config = {**TINY_CONFIGS[name], **keys}
    return {**config, "model_type": config.get("model_type", name)}


def test_internlm3_hub_spelling_reads_as_transformers_names():
    hub = model_args_from_config(tiny("internlm3", qkv_bias=True, bias=True))
    named = {k: v for k, v in tiny("internlm3").items() if k not in ("qkv_bias", "bias")}
    assert hub == model_args_from_config({**named, "attention_bias": True, "mlp_bias": True})
    assert hub.attention_bias and hub.attention_out_bias and hub.mlp_bias


def test_exaone_hub_spelling_reads_as_transformers_names():
    """EXAONE 3's hub configs: num_layers, layer_norm_epsilon, activation_function."""
    named = tiny("exaone", num_hidden_layers=3, rms_norm_eps=1e-6, hidden_act="silu")
    hub = {k: v for k, v in named.items() if k not in ("num_hidden_layers", "rms_norm_eps", "hidden_act")}
    hub.update(num_layers=3, layer_norm_epsilon=1e-6, activation_function="silu")
    assert model_args_from_config(hub) == model_args_from_config(named)


def test_minimax_m2_hub_rotary_dim_is_partial_rope():
    v5 = tiny("minimax_m2")
    hub = {k: v for k, v in v5.items() if k != "rope_parameters"}
    hub.update(rope_theta=10000.0, rotary_dim=8)
    assert model_args_from_config(hub) == model_args_from_config(v5)
    assert model_args_from_config(hub).partial_rotary_factor == 0.5


def test_sarvam_moe_hub_spelling_reads_as_transformers_names():
    named = tiny("sarvam_moe")
    hub = {k: v for k, v in named.items() if k not in ("n_routed_experts", "n_shared_experts", "attention_bias")}
    hub.update(num_experts=8, num_shared_experts=1, use_qkv_bias=True)
    args = model_args_from_config(hub)
    assert args == model_args_from_config(named)
    assert args.num_experts == 8 and args.attention_bias and not args.attention_out_bias


def test_hunyuan_classic_rope_scaling_is_ntk_alpha():
    """transformers 4 / hub spelling: rope_scaling {"type": "dynamic", "alpha"} and rope_theta;
    the base becomes theta * alpha^(d / (d - 2))."""
    v5 = tiny("hunyuan_v1_dense")
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling={"type": "dynamic", "alpha": 50.0, "factor": 1.0})
    args = model_args_from_config(v4)
    assert args == model_args_from_config(v5)
    assert args.rope_scaling is None and math.isclose(args.rope_theta, 10000.0 * 50.0 ** (16 / 14))


@pytest.mark.parametrize("model_type,keys,message", [
    ("hunyuan_v1_dense", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0, "factor": 2.0}},
     "HunYuan with 'dynamic' RoPE scaling is not supported"),
    ("hunyuan_v1_moe", {"moe_topk": [1, 2]}, "a different moe_topk per layer"),
    ("gpt_bigcode", {"scale_attn_weights": False}, "scale_attn_weights false"),
    ("mistral3", {"text_config": {"model_type": "mistral4"}}, "mistral3 with a 'mistral4' text model"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim other than hidden_size"),
    ("opt", {"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine false"),
])
def test_unsupported_options_are_named(model_type, keys, message):
    with pytest.raises(UserError, match=message):
        model_args_from_config(tiny(model_type, **keys))


def test_ernie4_5_moe_layers_follow_start_end_and_interval():
    args = model_args_from_config(tiny("ernie4_5_moe", num_hidden_layers=6, moe_layer_start_index=1,
                                       moe_layer_end_index=-1, moe_layer_interval=2))
    assert [args.has_experts(i) for i in range(6)] == [False, True, False, True, False, True]
    args = model_args_from_config(tiny("ernie4_5_moe", num_hidden_layers=4, moe_layer_end_index=2))
    assert [args.has_experts(i) for i in range(4)] == [False, True, True, False]


def test_query_position_scale_formula_and_rows():
    """1 + beta * log(1 + floor(p / period)) at each position; per-row offsets (a batch)
    give each row what its own scalar offset gives."""
    beta, period = 0.5, 4
    expected = [1 + beta * math.log(1 + math.floor(p / period)) for p in range(3, 9)]
    np.testing.assert_allclose(np.array(query_position_scale(3, 6, beta, period)).ravel(), expected, rtol=1e-6)
    rows = query_position_scale(mx.array([0, 7]), 6, beta, period)  # (B, 1, L, 1)
    assert rows.shape == (2, 1, 6, 1)
    for b, offset in enumerate((0, 7)):
        alone = np.array(query_position_scale(offset, 6, beta, period))[:, 0]
        np.testing.assert_array_equal(np.array(rows[b, 0, :, 0]), alone)


def numpy_sparsemixer(logits: np.ndarray, k: int, eps: float):
    """transformers' PhimoeTopKRouter at inference, generalised to k rounds, in numpy."""
    chosen, weights = [], []
    masked = logits.copy()
    for _ in range(k):
        index = masked.argmax()
        top = masked[index]
        outside = (top - logits) / np.maximum(np.abs(logits), top) > 2 * eps
        band = np.where(outside, -np.inf, masked)
        band = np.exp(band - band.max()) / np.exp(band - band.max()).sum()
        chosen.append(index)
        weights.append(band[index])
        masked[index] = -np.inf
    return chosen, weights


@pytest.mark.parametrize("eps", [0.01, 0.3, 2.0])
def test_sparsemixer_follows_its_formula(eps):
    args = ModelArgs.from_dict(dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_experts=8,
                                    num_experts_per_tok=3, router_scoring="sparsemixer", router_jitter_eps=eps))
    logits = np.random.default_rng(1).normal(size=(5, 8)).astype(np.float32)
    indices, weights = route(mx.array(logits), args)
    for row in range(5):
        chosen, expected = numpy_sparsemixer(logits[row], 3, eps)
        assert np.array(indices[row]).tolist() == chosen
        np.testing.assert_allclose(np.array(weights[row]), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ministral3", "hunyuan_v1_dense", "nemotron", "phimoe", "ernie4_5_moe"])
def test_full_forward_equals_cached_decode(name):
    """The mechanisms read positions from the cache: prefill + one token at a time gives the
    logits of one full forward."""
    args = model_args_from_config(tiny(name))
    mx.random.seed(0)
    model = Model(args)
    ids = mx.array([[5, 17, 200, 33, 9, 101, 64, 250, 3, 77]])
    full = model(ids)
    cache = model.make_cache()
    steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(4, 10)]
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)), np.array(full), atol=1e-4, rtol=0)
