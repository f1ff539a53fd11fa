"""Multi-head latent attention (mlx_tfm/model/latent_attention.py): the absorbed form equals
the expanded one, a cached run equals the full forward, the cache holds only the latent
and the rotary key, a quantized cache and quantized per-head matrices are read as they
are, and settings the latents cannot be quantized with are refused. (Parity with
transformers: tests/convert/test_convert_architectures.py and tests/families/.)"""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tfm.cpu import generic_routes
from mlx_tfm.errors import UserError
from mlx_tfm.model.cache import KVCache, KVQuantization, QuantizedKVCache
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.latent_attention import (HeadLinear, LatentAttention, QuantizedHeadLinear,
                                              latent_softmax_scale)
from mlx_tfm.model.transformer import Model

LATENT, ROPE = 32, 32  # widths 32-groups divide, so the cache can be quantized
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
        "mscale_all_dim": 0.707}


def tiny_args(**overrides) -> ModelArgs:
    fields = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=96, tie_word_embeddings=False, kv_lora_rank=LATENT,
                  q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=ROPE, v_head_dim=24,
                  head_dim=16 + ROPE, rope_traditional=True, rope_scaling=YARN, max_position_embeddings=64)
    return ModelArgs.from_dict({**fields, **overrides})


def layer(**overrides) -> LatentAttention:
    mx.random.seed(0)
    mla = LatentAttention(tiny_args(**overrides), 0)
    mx.eval(mla.parameters())
    return mla


def hidden(length: int, seed: int = 1) -> mx.array:
    return mx.random.normal((2, length, 64), key=mx.random.key(seed))


def prefilled(mla: LatentAttention, x: mx.array, cache) -> None:
    mla(x, "causal", cache)


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 0, "rope_traditional": False, "rope_scaling": None}],
                         ids=["q_lora_yarn", "q_proj_halves"])
def test_absorbed_equals_expanded(overrides):
    mla = layer(**overrides)
    x = hidden(7)
    np.testing.assert_allclose(mla(x, "causal", None, absorbed=True), mla(x, "causal", None, absorbed=False),
                               atol=1e-5, rtol=0)
    # a chunk of three after four cached positions, and one position (the decoding case)
    for length in (3, 1):
        caches = [KVCache(), KVCache()]
        for cache in caches:
            prefilled(mla, x[:, :4], cache)
        new = x[:, 4 : 4 + length]
        mask = "causal" if length > 1 else None
        absorbed = mla(new, mask, caches[0], absorbed=True)
        expanded = mla(new, mask, caches[1], absorbed=False)
        np.testing.assert_allclose(absorbed, expanded, atol=1e-5, rtol=0)


def naive_mla(mla: LatentAttention, x: mx.array) -> mx.array:
    """The layer written out from its formula with full per-head keys and values, kv_b_proj
    as one (H * (nope + v), R) matrix, and an explicit causal softmax."""
    B, L, _ = x.shape
    H, nope, P, v, R = mla.n_heads, mla.nope_dim, mla.rope_dim, mla.v_dim, mla.latent_dim
    q = mla.q_b_proj(mla.q_a_layernorm(mla.q_a_proj(x))).reshape(B, L, H, nope + P).transpose(0, 2, 1, 3)
    q_pe = mla.rope(q[..., nope:])
    compressed = mla.kv_a_proj_with_mqa(x)
    latent = mla.kv_a_layernorm(compressed[..., :R])  # (B, L, R)
    k_pe = mla.rope(compressed[..., None, R:].transpose(0, 2, 1, 3))  # (B, 1, L, P)
    kv_b = mx.concatenate([mla.embed_q.weight.swapaxes(-1, -2), mla.unembed_out.weight], axis=1)  # (H, nope + v, R)
    kv = (latent @ kv_b.reshape(H * (nope + v), R).T).reshape(B, L, H, nope + v).transpose(0, 2, 1, 3)
    keys = mx.concatenate([kv[..., :nope], mx.broadcast_to(k_pe, (B, H, L, P))], axis=-1)
    scale = (nope + P) ** -0.5 * (0.1 * 0.707 * math.log(4.0) + 1) ** 2
    scores = (mx.concatenate([q[..., :nope], q_pe], axis=-1) @ keys.swapaxes(-1, -2)) * scale
    scores = mx.where(mx.tril(mx.ones((L, L), mx.bool_)), scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ kv[..., nope:]
    return mla.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, H * v))


def test_matches_the_formula_with_the_mscale_softmax():
    mla = layer()
    x = hidden(6)
    np.testing.assert_allclose(mla(x, "causal"), naive_mla(mla, x), atol=1e-5, rtol=0)
    assert latent_softmax_scale(48, YARN) == pytest.approx(48**-0.5 * (0.1 * 0.707 * math.log(4) + 1) ** 2)
    assert latent_softmax_scale(48, None) == 48**-0.5


def tiny_model(**overrides) -> Model:
    mx.random.seed(0)
    model = Model(tiny_args(**overrides))
    mx.eval(model.parameters())
    return model


def test_full_forward_equals_prefill_then_cached_decode():
    model = tiny_model()
    tokens = mx.array([[5, 17, 200, 33, 9, 101, 64, 250, 3, 77]])
    full = model(tokens)
    cache = model.make_cache()
    assert all(type(c) is KVCache for c in cache)
    steps = [model(tokens[:, :6], cache=cache)]
    steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(6, 10)]
    np.testing.assert_allclose(mx.concatenate(steps, axis=1), full, atol=1e-4, rtol=0)


def test_cache_holds_the_latent_and_the_rotary_key_per_position():
    model = tiny_model()
    cache = model.make_cache()
    model(mx.array([[5, 17, 200, 33, 9, 101, 64]]), cache=cache)
    for layer_cache in cache:
        latents, rotary_keys = layer_cache.state
        assert latents.shape == (1, 1, 7, LATENT) and rotary_keys.shape == (1, 1, 7, ROPE)
        per_position = (latents.nbytes + rotary_keys.nbytes) // 7
        assert per_position == (LATENT + ROPE) * latents.dtype.size
    full_kv = 4 * (16 + ROPE + 24) * 4  # what per-head keys and values would take, float32
    assert per_position * 3 < full_kv


def test_quantized_cache_is_read_as_it_is():
    """Attention over the packed latents equals the same attention over their
    dequantized numbers, and 8 bits stay close to the float cache."""
    mla = layer()
    x = hidden(6)
    quantized = QuantizedKVCache(KVQuantization(bits=8, start=0))
    prefilled(mla, x[:, :5], quantized)
    out = mla(x[:, 5:], None, quantized)
    latents, rotary_keys = quantized.keys.dequantize()[..., :6, :], quantized.values.dequantize()[..., :6, :]
    q_nope, q_pe = mla._queries(x[:, 5:], 5)
    reference = mla._absorbed(q_nope, q_pe, latents, rotary_keys, None)
    reference = mla.o_proj(reference.transpose(0, 2, 1, 3).reshape(2, 1, -1))
    np.testing.assert_allclose(out, reference, atol=1e-5, rtol=0)
    float_cache = KVCache()
    prefilled(mla, x[:, :5], float_cache)
    np.testing.assert_allclose(out, mla(x[:, 5:], None, float_cache), atol=2e-2, rtol=0)


def test_a_prompt_chunk_over_a_quantized_cache_in_both_forms():
    """The expanded form reads the dequantized latents, the absorbed one the packed ones:
    the same numbers."""
    mla = layer()
    x = hidden(8)
    caches = [QuantizedKVCache(KVQuantization(bits=4, start=0)) for _ in range(2)]
    for cache in caches:
        prefilled(mla, x[:, :5], cache)
    expanded = mla(x[:, 5:], "causal", caches[0])
    np.testing.assert_allclose(expanded, mla(x[:, 5:], "causal", caches[1], absorbed=True), atol=1e-5, rtol=0)


def test_quantized_cache_after_a_float_start_matches_the_float_prefix():
    """Before ``start`` the quantized cache is a float one: the same numbers."""
    mla = layer()
    x = hidden(4)
    quantized, float_cache = QuantizedKVCache(KVQuantization(bits=4, start=100)), KVCache()
    np.testing.assert_array_equal(mla(x, "causal", quantized), mla(x, "causal", float_cache))


def test_latents_that_groups_do_not_divide_are_refused():
    mla = layer(qk_rope_head_dim=16, head_dim=32)
    cache = QuantizedKVCache(KVQuantization(bits=4, group_size=32, start=0))
    with pytest.raises(UserError, match="16-wide rotary keys, which groups of 32 do not divide"):
        mla(hidden(3), "causal", cache)


def test_quantized_per_head_matrices_in_both_forms():
    mla = layer(qk_nope_head_dim=32, head_dim=32 + ROPE)
    x = hidden(5)
    float_out = mla(x, "causal")
    nn.quantize(mla, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, HeadLinear))
    assert isinstance(mla.embed_q, QuantizedHeadLinear) and isinstance(mla.unembed_out, QuantizedHeadLinear)
    np.testing.assert_allclose(mla(x, "causal", absorbed=True), mla(x, "causal", absorbed=False), atol=1e-5, rtol=0)
    assert float(mx.abs(mla(x, "causal") - float_out).max()) < 0.1 * float(mx.abs(float_out).max())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("transpose", [True, False])
def test_quantized_per_head_matrices_over_many_rows_on_the_cpu_route_equal_the_plain_route(transpose, dtype):
    """A prompt's latents through quantized per-head matrices: made float32 whole on the
    CPU route, MLX's quantized_matmul on the plain one (Metal's and CUDA's)."""
    layer_ = HeadLinear(32, 64, 3).to_quantized(group_size=32, bits=4)
    x = mx.random.normal((2, 1, 40, 32 if transpose else 64), key=mx.random.key(3)).astype(dtype)
    fast = layer_(x, transpose=transpose)
    with generic_routes():
        plain = layer_(x, transpose=transpose)
    assert fast.dtype == plain.dtype and fast.shape == plain.shape == (2, 3, 40, 64 if transpose else 32)
    tolerance = 1e-5 if dtype == mx.float32 else 0.05
    np.testing.assert_allclose(np.array(fast.astype(mx.float32)), np.array(plain.astype(mx.float32)),
                               atol=tolerance, rtol=0)


def test_the_engines_batched_cache_holds_latents_unchanged():
    """Rows of different lengths, each first run alone, then a padded-free chunk read
    together (a ``CausalRows`` mask, the expanded form) and decoded together (absorbed):
    every row gets the logits of its own tokens run alone without a cache."""
    from mlx_tfm.engine.batch_cache import BatchKVCache, layer_windows

    model = tiny_model()
    windows = layer_windows(model, None)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(3, 256, size=n).tolist() for n in (0, 6, 2)]
    group = [BatchKVCache(w) for w in windows]
    for seq in sequences:
        row = [BatchKVCache.for_row(None, None, 0, w) for w in windows]
        if seq:
            model(mx.array(seq)[None], cache=row)
        for layer_cache, joined in zip(group, row):
            layer_cache.extend(joined)
    chunk = rng.integers(3, 256, size=(3, 4))
    logits = np.array(model(mx.array(chunk), cache=group)[:, -1])
    for _ in range(3):
        for i, seq in enumerate(sequences):
            seq += chunk[i].tolist() if chunk.shape[1] > 1 else [int(chunk[i, 0])]
            expected = np.array(model(mx.array(seq)[None])[0, -1])
            np.testing.assert_allclose(logits[i], expected, atol=2e-4, rtol=1e-4)
        chunk = rng.integers(3, 256, size=(3, 1))
        logits = np.array(model(mx.array(chunk), cache=group)[:, -1])
    assert group[0].keys.shape[-1] == LATENT and group[0].values.shape[-1] == ROPE
