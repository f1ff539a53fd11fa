"""The quantized KV cache (QuantizedKVCache, attention over QuantizedKV): exact against
attention over the dequantized cache and against mlx_lm's QuantizedKVCache, logits within
stated bounds of the float cache over 500 positions, its memory, trimming, files, the CPU
route against the generic one, and bad settings."""

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_tfm.model.attention as attention_module
from mlx_tfm import load, stream_generate
from mlx_tfm.model.attention import attention, quantized_attention
from mlx_tfm.model.cache import KVCache, KVQuantization, QuantizedKV, QuantizedKVCache, quantized_layers
from mlx_tfm.chat.conversation import ChatSession, Settings
from mlx_tfm.cli import main
from mlx_tfm.cli.generate import SHIPPED_MODEL
from mlx_tfm.cpu import generic_routes
from mlx_tfm.cpu.kernels import kernels
from mlx_tfm.errors import UserError
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.generation.sampling import make_sampler

from fixtures.model_folders import with_chat_template

GROUP = 32  # the shipped model's head_dim is 32


@pytest.fixture(scope="module")
def shipped():
    """The tiny story model shipped in the package: trained, head_dim 32, 1024 positions."""
    return load(SHIPPED_MODEL)


@pytest.fixture(scope="module")
def own_text_ids(shipped) -> list[int]:
    """BOS and 499 tokens the shipped model wrote itself (temperature 1, seeded)."""
    model, tokenizer = shipped
    mx.random.seed(0)
    responses = stream_generate(model, tokenizer, [1], max_tokens=520, sampler=make_sampler(temp=1.0))
    return [1] + [r.token for r in responses][:499]


def decode(model, ids: list[int], cache, prompt: int = 20) -> np.ndarray:
    """Logits (len(ids), V): a prompt chunk, then one token at a time."""
    out = [model(mx.array([ids[:prompt]]), cache=cache)[0]]
    out += [model(mx.array([[t]]), cache=cache)[0] for t in ids[prompt:]]
    return np.array(mx.concatenate(out).astype(mx.float32))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# -- attention over the packed cache ----------------------------------------------------------


def random_qkv(L: int, S: int, dtype=mx.float32, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 64):
    mx.random.seed(1)
    queries = mx.random.normal((2, n_heads, L, head_dim)).astype(dtype)
    keys = mx.random.normal((2, n_kv_heads, S, head_dim)).astype(dtype)
    values = mx.random.normal((2, n_kv_heads, S, head_dim)).astype(dtype)
    return queries, keys, values


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("L, mask", [(1, None), (7, "causal"), (7, "bool")])
def test_quantized_attention_equals_attention_over_the_dequantized_cache(bits, L, mask):
    """The same numbers as the fused op over ``mx.dequantize``d keys and values: nothing
    but the quantization itself changes the result."""
    queries, keys, values = random_qkv(L, 40)
    qk, qv = (QuantizedKV.quantize(x, 64, bits) for x in (keys, values))
    if mask == "bool":
        mask = mx.random.uniform(shape=(L, 40)) > 0.3
    ours = quantized_attention(queries, qk, qv, 0.125, mask)
    reference = mx.fast.scaled_dot_product_attention(queries, qk.dequantize(), qv.dequantize(), scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(reference), atol=2e-5)


def test_quantized_attention_with_sinks_and_softcap_equals_the_float_paths():
    queries, keys, values = random_qkv(5, 30)
    qk, qv = (QuantizedKV.quantize(x, 64, 8) for x in (keys, values))
    keys, values = qk.dequantize(), qv.dequantize()
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    with_sinks = quantized_attention(queries, qk, qv, 0.125, "causal", sinks=sinks)
    reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal", sinks=sinks)
    np.testing.assert_allclose(np.array(with_sinks), np.array(reference), atol=2e-5)
    capped = quantized_attention(queries, qk, qv, 0.125, "causal", cap=3.0)
    reference = attention_module.softcapped_attention(queries, keys, values, 0.125, "causal", 3.0)
    np.testing.assert_allclose(np.array(capped), np.array(reference), atol=2e-5)


@pytest.mark.parametrize("L", [1, 3, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_cpu_route_agrees_with_the_generic_route(dtype, L, monkeypatch):
    """On the CPU the queries, scales and biases become float32 (MLX's CPU kernel is slow
    with half precision) and the scores of a few queries per KV head take mlx_tfm's
    quantized_matvec kernel; the generic route (Metal's) keeps the dtype and MLX's product.
    Both land within rounding of a float64 reference of attention over the dequantized cache."""
    calls = {"in_float32": 0, "scores": 0}
    for module, name in ((attention_module, "in_float32"), (attention_module.cpu_quantized, "scores")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _f(*a))
    queries, keys, values = random_qkv(L, 50, dtype)
    qk, qv = (QuantizedKV.quantize(x, 64, 4) for x in (keys, values))
    cpu = attention(queries, qk, qv, 0.125, "causal" if L > 1 else None)
    kernel_in_use = kernels() is not None and 2 * L < 16  # n_rep 2 queries per KV head
    assert calls == {"in_float32": 1, "scores": int(kernel_in_use)} and cpu.dtype == dtype
    with generic_routes():
        generic = attention(queries, qk, qv, 0.125, "causal" if L > 1 else None)
    assert calls == {"in_float32": 1, "scores": int(kernel_in_use)} and generic.dtype == dtype
    k, v, q = (np.array(x.astype(mx.float32), np.float64) for x in (qk.dequantize(), qv.dequantize(), queries))
    scores = np.einsum("bkrld,bksd->bkrls", q.reshape(2, 2, 2, L, 64), k) * 0.125
    scores = np.where(np.tril(np.ones((L, 50)), 50 - L) > 0, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    reference = np.einsum("bkrls,bksd->bkrld", weights / weights.sum(-1, keepdims=True), v).reshape(2, 4, L, 64)
    tolerance = {mx.float32: 1e-5, mx.float16: 0.02, mx.bfloat16: 0.1}[dtype]
    for out in (cpu, generic):
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), reference, atol=tolerance)


# -- a whole model -------------------------------------------------------------------------


def test_logits_equal_mlx_lms_quantized_cache(shipped, own_text_ids):
    """mlx_lm's QuantizedKVCache on the same model folder and tokens: the same logits."""
    import mlx_lm
    from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantizedKVCache

    model, _ = shipped
    ids = own_text_ids[:120]
    reference_model, _ = mlx_lm.load(str(SHIPPED_MODEL))
    for bits in (8, 4):
        ours = decode(model, ids, quantized_layers(model.make_cache(), KVQuantization(bits, GROUP, start=0)))
        theirs = decode(reference_model, ids, [MlxLmQuantizedKVCache(group_size=GROUP, bits=bits)
                                               for _ in reference_model.layers])
        # float rounding of the keys before quantizing (other fused ops) moves a number
        # across a quantization step now and then: agreement to 1e-4 on average
        difference = np.abs(ours - theirs)
        assert difference.mean() < 1e-4 and difference.max() < 0.02


@pytest.mark.parametrize("bits, mean_bound, max_bound, agreement, kl_bound", [
    (8, 0.02, 1.0, 0.98, 1e-3),
    (4, 0.3, 6.0, 0.85, 0.06),
])
def test_logits_stay_within_the_stated_bound_of_the_float_cache_over_500_positions(
        shipped, own_text_ids, bits, mean_bound, max_bound, agreement, kl_bound):
    """The shipped model on 500 positions of its own text, every key and value quantized
    (group 32). Measured: 8-bit mean |dlogit| 0.009, max 0.46, same top token at 99.2% of
    positions, mean KL 1.3e-4 nats; 4-bit 0.15, 3.6, 89.4%, 0.031 (logits' std 2.9)."""
    model, _ = shipped
    reference = decode(model, own_text_ids, model.make_cache())
    cache = quantized_layers(model.make_cache(), KVQuantization(bits, GROUP, start=0))
    quantized = decode(model, own_text_ids, cache)
    assert all(layer.is_quantized and layer.offset == 500 for layer in cache)
    difference = np.abs(quantized - reference)
    assert difference.mean() < mean_bound and difference.max() < max_bound
    assert (quantized.argmax(-1) == reference.argmax(-1)).mean() >= agreement
    p = log_softmax(reference)
    kl = (np.exp(p) * (p - log_softmax(quantized))).sum(-1)
    assert kl.mean() < kl_bound
    assert difference.mean() > 0  # it is quantized


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_memory_at_500_positions(dtype):
    """Bytes per position and layer: float 2 * n_kv_heads * head_dim * itemsize; quantized
    2 * n_kv_heads * (head_dim * bits / 8 + 2 * head_dim / group * itemsize) for the packed
    numbers and a scale and bias per group. head_dim 64, group 64: 4-bit is 0.28x float16."""
    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(dict(vocab_size=100, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=64, intermediate_size=64)))
    model.set_dtype(dtype)
    itemsize = 2 if dtype == mx.float16 else 4
    prompt = mx.array([[i % 100 for i in range(500)]])
    sizes = {}
    for bits in (None, 8, 4):
        cache = model.make_cache() if bits is None else quantized_layers(model.make_cache(),
                                                                         KVQuantization(bits, 64, start=0))
        for layer in cache:
            layer.reserve(500)
        model(prompt, cache=cache)
        mx.eval([layer.state for layer in cache])
        sizes[bits] = sum(layer.nbytes for layer in cache)
    assert sizes[None] == 2 * 500 * 2 * 1 * 64 * itemsize
    for bits in (8, 4):
        assert sizes[bits] == 2 * 500 * 2 * 1 * (64 * bits // 8 + 2 * itemsize)
    if dtype == mx.float16:
        assert sizes[4] / sizes[None] == pytest.approx(0.281, abs=1e-3) and sizes[8] / sizes[None] == 0.53125


def test_float_before_start_then_quantized(shipped, own_text_ids):
    model, _ = shipped
    ids = own_text_ids[:150]
    cache = quantized_layers(model.make_cache(), KVQuantization(8, GROUP, start=100))
    reference = decode(model, ids, model.make_cache())
    out = [model(mx.array([ids[:20]]), cache=cache)[0]]
    for t in ids[20:100]:
        out.append(model(mx.array([[t]]), cache=cache)[0])
    assert not cache[0].is_quantized and cache[0].offset == 100
    np.testing.assert_array_equal(np.array(mx.concatenate(out)), reference[:100])  # exactly the float cache
    out.append(model(mx.array([[ids[100]]]), cache=cache)[0])
    assert cache[0].is_quantized and cache[0].offset == 101 and cache[0].state[0].data.shape[2] == 101


def test_trim_then_refeed_gives_the_same_logits(shipped, own_text_ids):
    """Trimming (chat's undo, speculative rollback) forgets exactly the last positions,
    quantized or not; refeeding them reproduces the logits bit for bit."""
    model, _ = shipped
    ids = own_text_ids[:80]
    for start in (0, 50, 1000):
        cache = quantized_layers(model.make_cache(), KVQuantization(4, GROUP, start=start))
        first = decode(model, ids, cache)
        for layer in cache:
            assert layer.trim(30) == 30 and layer.offset == 50
        again = np.array(mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in ids[50:]]))
        np.testing.assert_array_equal(again, first[50:])


def test_token_cache_saves_loads_and_copies_a_quantized_cache(shipped, own_text_ids, tmp_path):
    model, _ = shipped
    ids = own_text_ids[:60]
    token_cache = TokenCache(model, kv_quantization=KVQuantization(8, GROUP, start=10))
    model(mx.array([ids[:40]]), cache=token_cache.layers)
    token_cache.record(ids[:40])
    twin = token_cache.copy()
    token_cache.save(tmp_path / "cache.safetensors")
    loaded = TokenCache.load(tmp_path / "cache.safetensors", model)
    assert all(isinstance(layer, QuantizedKVCache) and layer.is_quantized for layer in loaded.layers)
    assert loaded.tokens == ids[:40] and loaded.kv_quantization is None
    continued = [np.array(model(mx.array([ids[40:]]), cache=c.layers)) for c in (token_cache, loaded, twin)]
    np.testing.assert_array_equal(continued[0], continued[1])
    np.testing.assert_array_equal(continued[0], continued[2])
    # a float file read with a quantization asked for: its layers become quantized ones
    float_cache = TokenCache(model)
    model(mx.array([ids[:40]]), cache=float_cache.layers)
    float_cache.record(ids[:40])
    float_cache.save(tmp_path / "float.safetensors")
    converted = TokenCache.load(tmp_path / "float.safetensors", model, kv_quantization=KVQuantization(8, GROUP, 10))
    for layer, float_layer in zip(converted.layers, float_cache.layers):
        assert isinstance(layer, QuantizedKVCache) and layer.is_quantized
        for quantized, stored in zip(layer.state, float_layer.state):
            for a, b in zip(quantized.arrays, QuantizedKV.quantize(stored, GROUP, 8).arrays):
                np.testing.assert_array_equal(np.array(a), np.array(b))


def test_generate_and_chat_with_a_quantized_cache(shipped, own_text_ids, tmp_path):
    model, tokenizer = shipped
    cache = model.make_cache()
    responses = list(stream_generate(model, tokenizer, [1], max_tokens=40, prompt_cache=cache, kv_bits=8,
                                     kv_group_size=GROUP, quantized_kv_start=10))
    assert all(isinstance(layer, QuantizedKVCache) and layer.is_quantized for layer in cache)
    assert cache[0].offset == 1 + 40 and len(responses) == 40
    chat_model, chat_tokenizer = load(with_chat_template(SHIPPED_MODEL, tmp_path / "chat"))
    session = ChatSession(chat_model, chat_tokenizer, Settings(max_tokens=20),
                          kv_quantization=KVQuantization(4, GROUP, start=0))
    first = "".join(session.answer("Tell me a story."))
    assert session.undo()
    again = "".join(session.answer("Tell me a story."))  # the cache was trimmed back, then refilled
    assert first == again and session.cache.layers[0].offset == len(session.cache.tokens)
    assert all(isinstance(layer, QuantizedKVCache) for layer in session.cache.layers)


def test_kv_bits_alone_quantizes_a_head_of_32_in_groups_of_32(shipped, tmp_path):
    """The shipped model's head_dim is 32, which mlx_lm's usual group of 64 does not
    divide: with no group size given the cache is quantized in groups of 32, as when 32
    is given (the Python API; ``mlx-tfm generate`` is checked in test_generate_cli.py)."""
    model, tokenizer = shipped
    cache = model.make_cache()
    tokens = [r.token for r in stream_generate(model, tokenizer, [1], max_tokens=30, prompt_cache=cache, kv_bits=8,
                                               quantized_kv_start=0)]
    assert all(layer.is_quantized and layer.keys.group_size == GROUP for layer in cache)
    given = [r.token for r in stream_generate(model, tokenizer, [1], max_tokens=30, kv_bits=8, kv_group_size=GROUP,
                                              quantized_kv_start=0)]
    assert tokens == given
    token_cache = TokenCache(model, kv_quantization=KVQuantization(8, start=0))
    model(mx.array([[1, 5, 6]]), cache=token_cache.layers)
    token_cache.record([1, 5, 6])
    token_cache.save(tmp_path / "cache.safetensors")
    loaded = TokenCache.load(tmp_path / "cache.safetensors", model)
    assert all(layer.keys.group_size == GROUP for layer in loaded.layers)
    assert json.loads(mx.load(str(tmp_path / "cache.safetensors"), return_metadata=True)[1]["layers"])[0][
        "group_size"] == GROUP


@pytest.mark.parametrize("head_dim, group", [(32, 32), (64, 64), (96, 32), (128, 128), (256, 128), (80, None)])
def test_the_default_group_is_the_largest_that_divides_the_head(head_dim, group):
    from mlx_tfm.model.cache import default_kv_group_size

    assert default_kv_group_size(head_dim) == group
    if group is None:
        with pytest.raises(UserError, match="no KV-cache group size .* divides the model's head_dim 80"):
            KVQuantization(8).check(head_dim)
    else:
        KVQuantization(8).check(head_dim)
        assert KVQuantization(8).group_for(head_dim) == group and KVQuantization(8, 32).group_for(head_dim) == 32


def test_speculative_decoding_over_a_quantized_cache_equals_plain_decoding_over_it(shipped):
    model, tokenizer = shipped
    settings = dict(max_tokens=80, kv_bits=4, kv_group_size=GROUP, quantized_kv_start=0)
    expected = [r.token for r in stream_generate(model, tokenizer, [1], **settings)]
    speculated = list(stream_generate(model, tokenizer, [1], draft_model=model, num_draft_tokens=4, **settings))
    assert [r.token for r in speculated] == expected and speculated[-1].accepted_tokens > 40


# -- bad settings -------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--kv-bits", "3"], "--kv-bits must be 4 or 8, got 3"),
    (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be 32, 64 or 128, got 48"),
    (["--kv-bits", "4", "--quantized-kv-start", "-1"], "--quantized-kv-start must be at least 0"),
    (["--kv-bits", "4", "--kv-group-size", "64"], "--kv-group-size 64 does not divide the model's head_dim 32"),
    (["--kv-bits", "4", "--kv-group-size", "32", "--max-kv-size", "64"], "--kv-bits with --max-kv-size is not supported"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_kv_settings_are_one_line(command, argv, message, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", open("/dev/null"))
    code = main([command, "--model", str(SHIPPED_MODEL), "--max-tokens", "2", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: ") and "\n" not in err and message in err, err


def test_quantizing_a_rotating_cache_is_refused():
    from mlx_tfm.model.cache import RotatingKVCache, check_quantizable

    with pytest.raises(UserError, match="rotating cache is not quantized"):
        check_quantizable([RotatingKVCache(64)], KVQuantization(8), 64)
    layers = quantized_layers([RotatingKVCache(64), KVCache()], KVQuantization(8))  # sliding layers stay float
    assert type(layers[0]) is RotatingKVCache and type(layers[1]) is QuantizedKVCache


@pytest.mark.parametrize("argv, message", [
    (["--kv-bits", "4"], "--kv-bits is not supported by mlx-tfm server"),
    (["--kv-bits", "3"], "--kv-bits must be 4 or 8, got 3"),
    (["--draft-model", str(SHIPPED_MODEL)], "speculative decoding (--draft-model, --prompt-lookup-num-tokens) is not "
                                            "supported by mlx-tfm server"),
    (["--prompt-lookup-num-tokens", "4"], "is not supported by mlx-tfm server"),
])
def test_the_server_refuses_what_its_batching_engine_cannot_do(argv, message, capsys):
    code = main(["server", "--model", str(SHIPPED_MODEL), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: ") and "\n" not in err and message in err, err
