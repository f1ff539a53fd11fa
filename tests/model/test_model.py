"""The model core: every variant builds and runs, cached decoding equals the full forward,
the seed explanations' worked numbers come out of the modules, and the real stories260K
model reproduces its golden logits and text."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_tfm.model.cache import KVCache, RotatingKVCache, window_mask
from mlx_tfm.cpu.switch import prompt_layer_by_layer
from mlx_tfm.loading import load_model
from mlx_tfm.model.layers import MLP, make_norm
from mlx_tfm.model.transformer import Model, count_parameters
from mlx_tfm.model.config import ModelArgs

from fixtures.variants import BASE, TOKENS, VARIANTS, build, decode_in_pieces


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_every_variant_runs_forward(variant, dtype):
    model = build(variant)
    model.set_dtype(dtype)
    logits = model(TOKENS)
    assert logits.shape == (1, TOKENS.shape[1], BASE["vocab_size"])
    assert logits.dtype == dtype
    assert bool(mx.all(mx.isfinite(logits)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_forward_equals_prefill_plus_cached_decode(variant):
    model = build(variant)
    full = model(TOKENS)
    stepped = decode_in_pieces(model, TOKENS, model.make_cache())
    np.testing.assert_allclose(np.array(stepped), np.array(full), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", [*VARIANTS, "olmo2-post-sublayer"])
def test_a_prompt_read_one_sublayer_at_a_time_gives_the_same_logits_and_cache(variant):
    """``prompt_layer_by_layer`` (generate's prefill) evaluates the residual stream between
    sublayers, wherever the norms sit: it changes when values are computed, never what."""
    if variant == "olmo2-post-sublayer":
        mx.random.seed(0)
        model = Model(ModelArgs.from_dict({**BASE, "norm_placement": "post_sublayer"}))
        mx.eval(model.parameters())
    else:
        model = build(variant)
    whole_cache, by_sublayer_cache = model.make_cache(), model.make_cache()
    whole = model(TOKENS, cache=whole_cache)
    with prompt_layer_by_layer():
        by_sublayer = model(TOKENS, cache=by_sublayer_cache)
    assert np.array_equal(np.array(by_sublayer), np.array(whole))
    for a, b in zip(whole_cache, by_sublayer_cache):
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.state, b.state))


@pytest.mark.parametrize("variant", ["llama-gqa", "gpt2-style-mqa", "qwen3-qk-norm"])
def test_rotating_cache_equals_plain_cache_under_its_bound(variant):
    model = build(variant)
    plain = decode_in_pieces(model, TOKENS, model.make_cache())
    rotating_cache = model.make_cache(max_kv_size=TOKENS.shape[1])
    assert all(isinstance(c, RotatingKVCache) for c in rotating_cache)
    rotating = decode_in_pieces(model, TOKENS, rotating_cache)
    np.testing.assert_allclose(np.array(rotating), np.array(plain), atol=1e-5)


@pytest.mark.parametrize("pieces", [(1,) * 11, (4, 1, 1, 3, 1, 1), (7, 4), (2, 5, 1, 3)])
def test_rotating_cache_past_its_bound_is_sliding_window_attention(pieces):
    # A bounded cache forgets keys more than max_size back: exactly a sliding window.
    window = 4
    windowed = Model(ModelArgs.from_dict({**BASE, "sliding_window": window}))
    bounded = Model(ModelArgs.from_dict(BASE))
    bounded.update(windowed.parameters())
    expected = windowed(TOKENS)
    got = decode_in_pieces(bounded, TOKENS, bounded.make_cache(max_kv_size=window), pieces)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)


def test_rotating_cache_keep_holds_the_first_positions():
    cache = RotatingKVCache(max_size=4, keep=1)
    for position in range(7):
        kv = mx.full((1, 1, 1, 2), float(position))
        keys, _ = cache.update_and_fetch(kv, kv)
    assert sorted(np.array(keys)[0, 0, :, 0].tolist()) == [0.0, 4.0, 5.0, 6.0]


def test_gqa_caches_kv_heads_without_repeating_them():
    model = build("llama-gqa")
    cache = model.make_cache()
    model(TOKENS, cache=cache)
    keys, values = cache[0].state
    assert keys.shape == (1, 2, TOKENS.shape[1], 8)  # n_kv_heads=2, not 6


def test_kv_cache_grows_in_steps_and_trims():
    cache = KVCache()
    kv = mx.zeros((1, 2, 3, 4))
    cache.update_and_fetch(kv, kv)
    assert cache.keys.shape[2] == KVCache.step
    assert cache.offset == 3
    assert cache.trim(2) == 2 and cache.offset == 1


@pytest.mark.parametrize("make", [KVCache, lambda: RotatingKVCache(max_size=1000)])
def test_reserved_cache_grows_only_to_the_reservation_then_in_steps(make):
    cache, unreserved = make(), make()
    cache.reserve(10)
    chunk = mx.random.normal((1, 2, 6, 4))
    for c in (cache, unreserved):
        c.update_and_fetch(chunk, chunk)
    for position in range(6, 11):  # the 11th position is past the reservation
        kv = mx.full((1, 2, 1, 4), float(position))
        keys, values = cache.update_and_fetch(kv, kv)
        expected_keys, _ = unreserved.update_and_fetch(kv, kv)
        assert mx.array_equal(keys, expected_keys) and mx.array_equal(values, expected_keys)
        if position < 10:
            assert cache.keys.shape[2] == 10  # never a slot beyond what was reserved
    assert cache.keys.shape[2] == 10 + make().step  # past it: steps again
    assert unreserved.keys.shape[2] >= unreserved.step


def test_model_args_from_dict_ignores_unknown_keys_and_derives_defaults():
    args = ModelArgs.from_dict({**BASE, "architectures": ["X"], "torch_dtype": "float32"})
    assert args.num_key_value_heads == 6
    assert args.head_dim == 8
    assert args.attention_scale == pytest.approx(8**-0.5)
    assert args.layer_types == ("full_attention", "full_attention")
    with pytest.raises(Exception):
        args.hidden_size = 3  # frozen


# -- the seed explanations' worked numbers -------------------------------------------


def test_layernorm_worked_example():
    # The seed: x = [0.001, 52.3, -0.0003, 18.7], mean 17.75, gamma 1, beta 0, eps 1e-5.
    # Its variance "~413.6, sigma ~20.34" is an arithmetic slip: the population variance
    # is 456.2 (sigma 21.36), so the exact outputs are [-0.831, 1.618, -0.831, 0.044]
    # where the seed rounds to [-0.87, 1.70, -0.87, 0.05] (5% high, same shape).
    x = np.array([0.001, 52.3, -0.0003, 18.7])
    assert x.mean() == pytest.approx(17.75, abs=1e-3)
    norm = make_norm(ModelArgs.from_dict({**BASE, "hidden_size": 4, "num_attention_heads": 1, "norm_type": "layernorm"}))
    out = np.array(norm(mx.array(x, dtype=mx.float32)))
    np.testing.assert_allclose(out, (x - x.mean()) / np.sqrt(x.var() + 1e-5), atol=1e-5)
    np.testing.assert_allclose(out, [-0.831, 1.618, -0.831, 0.044], atol=1e-3)
    # With the seed's own sigma the module reproduces the seed's printed numbers.
    np.testing.assert_allclose(out * np.sqrt(x.var()) / 20.34, [-0.87, 1.70, -0.87, 0.05], atol=0.005)


def test_gelu_worked_values():
    mlp_args = ModelArgs.from_dict({**BASE, "hidden_act": "gelu", "ffn_gated": False})
    gelu = MLP(mlp_args).act
    np.testing.assert_allclose(np.array(gelu(mx.array([-2.0, -1.0, 0.0, 1.0]))), [-0.045, -0.159, 0, 0.841], atol=6e-4)


def test_causal_mask_4x4():
    positions = mx.arange(4)
    mask = np.array(window_mask(positions, positions, None))
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(mask, expected)


def test_causal_mask_keeps_the_future_out_of_every_position():
    model = build("llama-gqa")
    changed = mx.concatenate([TOKENS[:, :6], mx.array([[1, 1, 1, 1, 1]])], axis=1)
    np.testing.assert_allclose(np.array(model(changed)[:, :6]), np.array(model(TOKENS)[:, :6]), atol=1e-6)


def test_parameter_count_reproduces_the_seed():
    # d = 512, d_ff = 2048: attention 4d^2, FFN 8d^2, so the FFN is about 2/3 of a block.
    d, d_ff = 512, 2048
    args = ModelArgs.from_dict(
        dict(vocab_size=10, hidden_size=d, num_hidden_layers=1, num_attention_heads=8, intermediate_size=d_ff,
             hidden_act="relu", ffn_gated=False, norm_type="layernorm")
    )
    block = Model(args).layers[0]
    attention, ffn = count_parameters(block.self_attn), count_parameters(block.mlp)
    assert attention == 4 * d * d == 1_048_576
    assert ffn == 8 * d * d == 2_097_152
    assert ffn / (attention + ffn) == pytest.approx(0.667, abs=0.001)
    norms = count_parameters(block) - attention - ffn
    assert norms == 2 * 2 * d  # two LayerNorms, weight and bias


def test_swiglu_with_8_3_d_matches_the_classic_ffn_budget():
    d = 512
    swiglu = MLP(ModelArgs.from_dict({**BASE, "hidden_size": d, "num_attention_heads": 8, "intermediate_size": 8 * d // 3}))
    assert abs(count_parameters(swiglu) - 8 * d * d) / (8 * d * d) < 0.01


# -- the real tiny model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def stories(stories_hf):
    model, _ = load_model(stories_hf)
    return model


def test_stories260k_logits_match_the_reference(stories, stories_dir, golden):
    reference = np.load(stories_dir / "greedy_reference_logits_first32.npy")
    ids = ([golden["bos_id"]] + golden["generated_ids"])[:32]
    logits = stories(mx.array([ids]))[0]
    np.testing.assert_allclose(np.array(logits), reference, atol=1e-4)


def test_stories260k_greedy_decode_with_cache_reproduces_golden_ids(stories, golden):
    cache = stories.make_cache()
    token, generated = mx.array([[golden["bos_id"]]]), []
    for _ in range(len(golden["generated_ids"])):
        next_id = mx.argmax(stories(token, cache=cache)[0, -1]).item()
        generated.append(next_id)
        token = mx.array([[next_id]])
    assert generated == golden["generated_ids"]
