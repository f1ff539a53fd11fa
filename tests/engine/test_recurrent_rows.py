"""The batching engine with recurrent layers (BatchStateCache): rows of an LFM2-like
model at different positions, joining and leaving mid-run, give the tokens each gives
alone; the prefix cache reuses a state only where it really holds the prefix."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.recurrent_models import tiny_lfm2, uncached_greedy_tokens

from mlx_tfm.engine.batch_cache import batch_caches
from mlx_tfm.engine.batch_state_cache import BatchStateCache
from mlx_tfm.engine.loop import Engine, batch_generate
from mlx_tfm.engine.requests import Request
from mlx_tfm.model.state_cache import StateCache
from mlx_tfm.tokenizer import load_tokenizer

PROMPTS = [[1, 5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140][: 3 + i] + [i + 20] * (i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def lfm2(stories_hf):
    return tiny_lfm2(vocab_size=512), load_tokenizer(stories_hf)


def reference(model, tokenizer, prompt, n) -> list[int]:
    """Greedy with no cache, ending at the first end-of-sequence token as the engine does."""
    tokens = uncached_greedy_tokens(model, prompt, n)
    ends = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
    return tokens[: ends[0] + 1] if ends else tokens


class Events:
    def __init__(self):
        self.events = {}

    def __call__(self, key):
        return lambda event: self.events.setdefault(key, []).append(event)

    def tokens(self, key) -> list[int]:
        return [e.token for e in self.events[key] if e.token is not None]


def test_the_engine_batches_recurrent_layers_with_state_caches(lfm2):
    model, _ = lfm2
    kinds = batch_caches(model, None)
    assert [type(k).__name__ for k in kinds] == ["BatchStateCache", "BatchKVCache", "BatchStateCache"]
    assert not kinds[0].takes_padding


@pytest.mark.parametrize("max_batch,prefill_step_size", [(8, 64), (3, 5)])
def test_rows_alone_equal_rows_joining_and_leaving_together(lfm2, max_batch, prefill_step_size):
    model, tokenizer = lfm2
    max_tokens = [6 + 2 * (i % 4) for i in range(len(PROMPTS))]
    engine = Engine(model, tokenizer, max_batch=max_batch, prefill_step_size=prefill_step_size)
    events = Events()
    join_at = {i: (i % 4) * 2 for i in range(len(PROMPTS))}
    steps = 0
    while True:
        for i, prompt in enumerate(PROMPTS):
            if join_at[i] == steps:
                engine.submit(Request(prompt, max_tokens[i]), events(i))
        busy = engine.step()
        steps += 1
        if not busy and steps > max(join_at.values()):
            break
    for i, prompt in enumerate(PROMPTS):
        assert events.tokens(i) == reference(model, tokenizer, prompt, max_tokens[i]), f"prompt {i}"


def test_batch_generate_equals_each_prompt_alone(lfm2):
    model, tokenizer = lfm2
    together = batch_generate(model, tokenizer, PROMPTS, max_tokens=8, prefill_step_size=7)
    alone = [batch_generate(model, tokenizer, [p], max_tokens=8)[0] for p in PROMPTS]
    assert together == alone


def test_a_second_turn_reuses_the_state_and_says_how_much(lfm2):
    model, tokenizer = lfm2
    engine = Engine(model, tokenizer)
    events = Events()
    first = PROMPTS[7]
    engine.submit(Request(first, 6), events("turn1"))
    while engine.step():
        pass
    second = first + events.tokens("turn1") + [40, 41, 42]
    engine.submit(Request(second, 6), events("turn2"))
    other = first[:5] + [60, 61]  # shares 5 tokens, but no state was kept at position 5
    engine.submit(Request(other, 6), events("other"))
    while engine.step():
        pass
    held = events.events["turn2"][-1].cached_tokens
    assert held in (len(first) + 5, len(first) + 6)  # the first turn's prompt and answer, exactly what it held
    assert events.events["other"][-1].cached_tokens == 0
    assert events.tokens("turn2") == reference(model, tokenizer, second, 6)
    assert events.tokens("other") == reference(model, tokenizer, other, 6)


def test_rows_stack_select_and_export_as_single_states():
    a, b = BatchStateCache(1), BatchStateCache(1)
    single = StateCache(1)
    single[0], single.offset = mx.ones((1, 2, 4)), 7
    a = a.row_from(single, 7)
    b = b.row_from(None, 0)  # a row with no state yet: zeros beside the others
    assert a.row_from(single, 5) is None  # a state cannot give an earlier prefix
    a.extend(b)
    assert a.size == 2 and a[0].shape == (2, 2, 4) and a.offset.tolist() == [7, 0]
    np.testing.assert_array_equal(np.array(a[0][1]), np.zeros((2, 4)))
    picked = a.select([1, 0])
    out = StateCache(1)
    picked.export_row(1, out)
    assert out.offset == 7 and out[0].shape == (1, 2, 4) and picked.holds_all(1, 7)
    with pytest.raises(ValueError, match="never padded"):
        a.drop_padding([0, 2])


def test_the_prefix_cache_resumes_a_state_at_the_longest_snapshot_inside_the_prefix(lfm2, monkeypatch):
    from mlx_tfm.engine import scheduler

    monkeypatch.setattr(scheduler, "SNAPSHOT_INTERVAL", 4)
    model, tokenizer = lfm2
    engine = Engine(model, tokenizer, prefill_step_size=64)
    events = Events()
    first = [1, 5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140]  # snapshots at 4, 8 and 12 (its prompt's end)
    engine.submit(Request(first, 4), events("first"))
    while engine.step():
        pass
    requests = {"shares 10": first[:10] + [90, 91], "shares the prompt": first[:12] + [92, 93, 94],
                "shares 3": first[:3] + [95, 96]}
    for name, prompt in requests.items():
        engine.submit(Request(prompt, 5), events(name))
        while engine.step():
            pass
    cached = {name: events.events[name][-1].cached_tokens for name in requests}
    assert cached == {"shares 10": 8, "shares the prompt": 12, "shares 3": 0}
    for name, prompt in requests.items():
        assert events.tokens(name) == reference(model, tokenizer, prompt, 5), name
    assert engine.metrics()["prompt_cache_misses"] == 2  # the first request and "shares 3": nothing resumable


def test_prefix_cache_entries_keep_the_states_of_the_prefixes_they_replace_or_extend():
    from mlx_tfm.engine.prefix_cache import PrefixCache
    from mlx_tfm.generation.token_cache import TokenCache

    model = tiny_lfm2()
    tokens = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140]

    def entry(n: int) -> TokenCache:
        cache = TokenCache(model)
        model(mx.array([tokens[:n]]), cache=cache.layers)
        cache.record(tokens[:n])
        return cache

    store = PrefixCache(1 << 20)
    store.insert(entry(6))
    store.insert(entry(10))  # extends the first: replaces it, keeping its state at 6
    assert len(store) == 1 and store.find(tokens[:8] + [1, 1], limit=9) == (1, 6)
    store.insert(entry(4))  # a prefix of the kept entry: only adds its state at 4
    assert len(store) == 1 and store.find(tokens[:5] + [1], limit=5) == (1, 4)
    assert store.find(tokens, limit=11) == (1, 10)
    assert store.find(tokens[:3] + [1], limit=3) == (None, 0)  # no state at 3 or before
    assert store.nbytes == sum(e.nbytes for e in store.entries.values())
    kept = store.entries[1]
    resumed = kept.layers_at(6)
    fresh = entry(6).layers
    np.testing.assert_allclose(np.array(resumed[0][0]), np.array(fresh[0][0]), atol=1e-6)
