"""Llama 4's one-chunk cache (mlx_tfm/model/chunked_cache.py) on the tiny llama4_text
model (chunks of 5 positions): cached decoding across several chunk boundaries gives the
full forward's logits while the cache holds about one chunk; trimming works back to the
positions it holds and is one line past them; prompt-cache files, ``TokenCache`` reuse,
speculative decoding and the batching engine's prefix cache work over it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.hybrid_models import reference_tokens, tiny_family_model

from mlx_tfm.engine.batch_chunked_cache import BatchChunkedKVCache
from mlx_tfm.engine.loop import Engine
from mlx_tfm.engine.requests import Request
from mlx_tfm.errors import UserError
from mlx_tfm.generation.prompt_cache import load_prompt_cache, save_prompt_cache
from mlx_tfm.generation.speculative import PromptLookup, speculative_generate_step
from mlx_tfm.generation.step import generate_step
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.model.cache import KVCache
from mlx_tfm.model.chunk_bound import chunk_bounded
from mlx_tfm.model.chunked_cache import ChunkedKVCache
from mlx_tfm.tokenizer import load_tokenizer

# 23 positions: chunks 0-4, 5-9, 10-14, 15-19 and the start of 20-24
PROMPT = [1, 5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11, 300, 7, 90, 12, 44, 5, 17, 200]
CHUNK = 5


@pytest.fixture(scope="module")
def model():
    model = tiny_family_model("llama4_text")
    assert model.args.attention_chunk_size == CHUNK
    assert model.args.layer_types == ("chunked_attention", "chunked_attention", "full_attention", "chunked_attention")
    return model


def bounded_cache(model) -> list:
    cache = chunk_bounded(model, model.make_cache())
    assert [type(c) for c in cache] == [ChunkedKVCache, ChunkedKVCache, KVCache, ChunkedKVCache]
    return cache


def logits_of(model, tokens: list[int], cache) -> np.ndarray:
    return np.array(model(mx.array([tokens]), cache=cache)[0])


def held(layer: ChunkedKVCache) -> int:
    """Positions the layer holds (its keys' slots in use)."""
    return layer.state[0].shape[2] if layer.state else 0


@pytest.mark.parametrize("pieces", [[1] * 23, [7, 1, 1, 6, 8], [3] * 7 + [2], [23]], ids=["steps", "mixed", "threes", "one"])
def test_cached_decode_across_chunks_equals_the_full_forward_and_holds_about_a_chunk(model, pieces):
    full = np.array(model(mx.array([PROMPT]))[0])
    cache, start, parts = bounded_cache(model), 0, []
    for n in pieces:
        parts.append(logits_of(model, PROMPT[start : start + n], cache))
        start += n
        for layer in (cache[0], cache[1], cache[3]):
            assert layer.offset == start and held(layer) <= CHUNK + n - 1
            if n == 1:
                assert held(layer) <= CHUNK
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-4, rtol=0)


def test_the_unbounded_kv_cache_holds_every_position(model):
    """What the bound saves: the same decode over make_cache's own caches holds them all."""
    cache = model.make_cache()
    for token in PROMPT:
        logits_of(model, [token], cache)
    assert cache[0].state[0].shape[2] == len(PROMPT)


@pytest.mark.parametrize("first,second,back", [(10, 2, 2), (8, 4, 4), (12, 1, 1)])
def test_trimming_back_within_what_is_held_then_feeding_again_equals_the_full_forward(model, first, second, back):
    """(8, 4, 4): the second update crosses the chunk start at 10, and trimming takes all of
    it back, as speculative decoding does with rejected guesses."""
    full = np.array(model(mx.array([PROMPT]))[0])
    cache = bounded_cache(model)
    logits_of(model, PROMPT[:first], cache)
    logits_of(model, PROMPT[first : first + second], cache)
    for layer in cache:
        assert layer.trim(back) == back
    position = first + second - back
    again = logits_of(model, PROMPT[position:], cache)
    np.testing.assert_allclose(again, full[position:], atol=1e-4, rtol=0)


def test_trimming_into_a_dropped_chunk_is_one_line(model):
    cache = bounded_cache(model)
    logits_of(model, PROMPT[:10], cache)
    logits_of(model, PROMPT[10:12], cache)  # the chunk of positions 0-9 is dropped
    layer = cache[0]
    assert layer.start == 10 and not layer.can_trim(3)
    with pytest.raises(UserError, match=r"cannot go back to position 9: it holds positions from 10 on") as error:
        layer.trim(3)
    assert "\n" not in str(error.value) and layer.offset == 12


def test_a_prompt_cache_file_holds_the_chunk_and_decoding_goes_on_from_it(model, tmp_path):
    full = np.array(model(mx.array([PROMPT]))[0])
    cache = bounded_cache(model)
    logits_of(model, PROMPT[:10], cache)
    logits_of(model, PROMPT[10:13], cache)  # drops positions 0-9
    save_prompt_cache(tmp_path / "cache.safetensors", cache)
    loaded, _ = load_prompt_cache(tmp_path / "cache.safetensors")
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert (loaded[0].start, loaded[0].offset, held(loaded[0])) == (10, 13, 3)
    np.testing.assert_allclose(logits_of(model, PROMPT[13:], loaded), full[13:], atol=1e-4, rtol=0)


def test_a_token_cache_reuses_a_prefix_within_the_chunk_and_starts_again_before_it(model):
    entry = TokenCache(model, None, bounded_cache(model), [])
    logits_of(model, PROMPT[:10], entry.layers)
    logits_of(model, PROMPT[10:14], entry.layers)  # drops positions 0-9
    entry.record(PROMPT[:14])
    assert entry.prepare(PROMPT[:12] + [3, 3]) == PROMPT[12:12] + [3, 3]  # 12 >= 10: trimmed
    assert entry.offset == 12
    assert entry.prepare(PROMPT[:6] + [3, 3]) == PROMPT[:6] + [3, 3]  # 6 < 10: its chunk is gone
    assert entry.offset == 0 and type(entry.layers[0]) is KVCache  # started again as make_cache makes them


def test_a_chunk_bound_token_cache_makes_and_copies_chunked_layers(model):
    entry = TokenCache(model, chunk_bound=True)
    assert [type(c) for c in entry.layers] == [ChunkedKVCache, ChunkedKVCache, KVCache, ChunkedKVCache]
    logits_of(model, PROMPT[:10], entry.layers)
    logits_of(model, PROMPT[10:12], entry.layers)
    entry.record(PROMPT[:12])
    twin = entry.copy()
    assert twin.prepare(PROMPT[:4] + [3]) == PROMPT[:4] + [3]  # position 4's chunk is gone: started again
    assert type(twin.layers[0]) is ChunkedKVCache and entry.offset == 12


def test_speculative_decoding_over_the_chunked_cache_gives_plain_greedy(model):
    """Prompt lookup guesses 3 tokens a round over chunks of 5: rounds cross chunk starts
    and their rejected guesses are trimmed off across them."""
    prompt = mx.array(PROMPT[:12] * 2)
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=16)]
    guessed = [t for t, _ in speculative_generate_step(prompt, model, PromptLookup(), num_draft_tokens=3, max_tokens=16)]
    assert guessed == plain


@pytest.fixture(scope="module")
def tokenizer(stories_hf):
    return load_tokenizer(stories_hf)


def run_engine(engine: Engine, prompt: list[int], n: int):
    tokens, last = [], []

    def collect(event) -> None:
        assert event.error is None, event.error
        if event.token is not None:
            tokens.append(event.token)
        if event.finish_reason is not None:
            last.append(event)

    engine.submit(Request(prompt, n), collect)
    while engine.step():
        pass
    return tokens, last[0]


def test_the_engine_batches_chunked_layers_in_a_chunk_and_reuses_their_prefixes(model, tokenizer):
    engine = Engine(model, tokenizer, prefill_step_size=4)
    assert [type(c) for c in engine._decode_cache] == [BatchChunkedKVCache, BatchChunkedKVCache,
                                                       type(engine._decode_cache[2]), BatchChunkedKVCache]
    assert engine._decode_cache[0].window == CHUNK
    first, event = run_engine(engine, PROMPT[:17], 8)
    assert first == reference_tokens(model, tokenizer, PROMPT[:17], 8) and event.cached_tokens == 0
    # a conversation going on: the entry holds the chunk its continuation starts in
    going_on = PROMPT[:17] + first + [9, 3]
    tokens, event = run_engine(engine, going_on, 8)
    assert tokens == reference_tokens(model, tokenizer, going_on, 8) and event.cached_tokens > 17
    # the first prompt again: the entry no longer holds the chunk of its position 16, so it starts again
    again, event = run_engine(engine, PROMPT[:17], 8)
    assert again == first and event.cached_tokens == 0


def test_the_engines_chunked_layers_keep_about_a_chunk_of_slots(model, tokenizer, monkeypatch):
    """Growing in steps of 4 slots, a chunked layer's batched cache drops what no query
    can see at each growth: it never holds more than chunk - 1 + 4 slots, while the full
    attention layer holds every position."""
    monkeypatch.setattr(BatchChunkedKVCache, "step", 4)
    engine = Engine(model, tokenizer, prefill_step_size=4)
    tokens, used = [], {0: [], 2: []}
    engine.submit(Request(PROMPT, 24), lambda event: tokens.append(event.token))
    while engine.step():
        for layer in used:
            if engine._decode_cache and engine._decode_cache[layer].size:
                used[layer].append(engine._decode_cache[layer].used)
    assert [t for t in tokens if t is not None] == reference_tokens(model, tokenizer, PROMPT, 24)
    assert max(used[2]) >= len(PROMPT) + 20 and max(used[0]) <= CHUNK - 1 + 4
