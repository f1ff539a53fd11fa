"""Falcon-H1's ``ParallelCache`` (attention with a Mamba-2 state beside it in one layer)
and Nemotron-H's MLP-only blocks (a ``StateCache(0)``) through the batching engine, the
prefix cache, prompt-cache files, ``TokenCache`` snapshots and speculative decoding: each
gives the tokens of the same model run plainly (greedy with no cache)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.hybrid_models import engine_tokens, reference_tokens, tiny_family_model
from fixtures.recurrent_models import uncached_greedy_tokens

from mlx_tfm.engine.batch_cache import batch_caches
from mlx_tfm.engine.batch_state_cache import BatchParallelCache
from mlx_tfm.errors import UserError
from mlx_tfm.generation.step import generate_step
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.model.cache import KVCache
from mlx_tfm.model.mamba import ParallelCache
from mlx_tfm.model.state_cache import StateCache
from mlx_tfm.tokenizer import load_tokenizer

PROMPTS = [[1, 5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11, 300][: 2 + 2 * i] for i in range(6)]
PROMPT = PROMPTS[-1]


@pytest.fixture(scope="module")
def tokenizer(stories_hf):
    return load_tokenizer(stories_hf)


@pytest.fixture(scope="module", params=["falcon_h1", "nemotron_h"])
def model(request):
    return tiny_family_model(request.param)


@pytest.fixture(scope="module")
def falcon():
    return tiny_family_model("falcon_h1")


def decode(model, prompt, n, cache=None) -> list[int]:
    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)]


def test_a_parallel_cache_layer_batches_as_keys_and_values_beside_a_state(falcon):
    kinds = batch_caches(falcon, None)
    assert all(isinstance(kind, BatchParallelCache) for kind in kinds)
    assert not kinds[0].takes_padding  # the scheduler never pads its rows
    with pytest.raises(ValueError, match="never padded"):
        kinds[0].drop_padding([0, 1])


@pytest.mark.parametrize("max_batch,prefill_step_size", [(8, 64), (3, 5)])
def test_batched_rows_equal_each_alone_and_plain_greedy(model, tokenizer, max_batch, prefill_step_size):
    together = engine_tokens(model, tokenizer, PROMPTS, 6, max_batch=max_batch, prefill_step_size=prefill_step_size)
    alone = [engine_tokens(model, tokenizer, [p], 6)[0] for p in PROMPTS]
    assert together == alone == [reference_tokens(model, tokenizer, p, 6) for p in PROMPTS]


def test_a_second_turn_resumes_from_the_prefix_cache(falcon, tokenizer):
    from mlx_tfm.engine.loop import Engine
    from mlx_tfm.engine.requests import Request

    engine = Engine(falcon, tokenizer)
    events = {}
    first = PROMPT
    engine.submit(Request(first, 5), lambda e: events.setdefault("one", []).append(e))
    while engine.step():
        pass
    answer = [e.token for e in events["one"] if e.token is not None]
    second = first + answer + [40, 41]
    engine.submit(Request(second, 5), lambda e: events.setdefault("two", []).append(e))
    while engine.step():
        pass
    assert events["two"][-1].cached_tokens >= len(first)  # the saved state and keys were reused
    assert [e.token for e in events["two"] if e.token is not None] == reference_tokens(falcon, tokenizer, second, 5)


def test_a_prompt_cache_file_round_trips_keys_values_and_state(model, tmp_path):
    cache = TokenCache(model)
    feed = cache.feed_to_snapshot(cache.prepare(PROMPT))
    assert feed == PROMPT[-1:]
    cache.save(tmp_path / "prompt.safetensors")
    loaded = TokenCache.load(tmp_path / "prompt.safetensors", model)
    assert [type(c) for c in loaded.layers] == [type(c) for c in model.make_cache()]
    assert {c.offset for c in loaded.layers} == {len(PROMPT) - 1}
    assert decode(model, loaded.prepare(PROMPT), 8, cache=loaded.layers) == uncached_greedy_tokens(model, PROMPT, 8)


def test_a_parallel_cache_file_read_as_another_layout_is_refused(falcon, tmp_path):
    cache = TokenCache(falcon)
    cache.feed_to_snapshot(PROMPT)
    cache.save(tmp_path / "prompt.safetensors")
    nemotron = tiny_family_model("nemotron_h")
    with pytest.raises(UserError, match="holds keys and values beside a recurrent state for layer 0, but this "
                                        "model's layer 0 keeps a recurrent state"):
        TokenCache.load(tmp_path / "prompt.safetensors", nemotron)


def test_parallel_cache_state_and_meta_state_restore_both_parts():
    single = ParallelCache(KVCache(), StateCache(2))
    keys = mx.arange(24, dtype=mx.float32).reshape(1, 2, 3, 4)  # (1, n_kv_heads, 3, head_dim)
    single.state = ((keys, keys + 1), (mx.ones((1, 5)), mx.zeros((1, 2, 2))))
    single.meta_state = {"kind": "ParallelCache", "attention": {"kind": "KVCache"},
                         "mamba": {"kind": "StateCache", "size": 2, "offset": 3}}
    assert single.offset == 3 and single.mamba.offset == 3
    np.testing.assert_array_equal(np.array(single.state[0][1]), np.array(keys + 1))
    assert single.meta_state["mamba"]["offset"] == 3


def test_prepare_goes_back_to_a_snapshot_of_keys_values_and_state(model):
    cache = TokenCache(model)
    for piece in (PROMPT[:4], PROMPT[4:9], PROMPT[9:]):
        decode(model, piece, 0, cache=cache.layers)
        cache.record(piece)
        cache.snapshot()
    other = PROMPT[:11] + [99, 98]
    feed = cache.prepare(other)
    assert feed == other[9:] and cache.tokens == PROMPT[:9]
    assert decode(model, feed, 6, cache=cache.layers) == uncached_greedy_tokens(model, other, 6)
    held = cache.offset
    twin = cache.copy()
    decode(model, [1, 2, 3], 0, cache=twin.layers)
    assert cache.offset == held and twin.offset == held + 3


def speculative(model, drafter, prompt, n, k=3):
    from mlx_tfm.generation.speculative import speculative_generate_step

    steps = speculative_generate_step(mx.array(prompt), model, drafter, num_draft_tokens=k, max_tokens=n)
    return [token for token, _ in steps]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_with_another_draft_gives_plain_greedy_tokens(model, k):
    from mlx_tfm.generation.speculative import DraftModel

    draft = tiny_family_model(model.args.model_type, seed=3)  # many of its guesses are rejected
    drafter = DraftModel(draft, draft.make_cache(), model.args.vocab_size)
    assert speculative(model, drafter, PROMPT, 12, k) == uncached_greedy_tokens(model, PROMPT, 12)


def test_prompt_lookup_gives_plain_greedy_tokens(model):
    from mlx_tfm.generation.speculative import PromptLookup

    prompt = PROMPT + PROMPT[:6] + PROMPT
    assert speculative(model, PromptLookup(), prompt, 12, k=4) == uncached_greedy_tokens(model, prompt, 12)
