"""The batching engine: continuous batching, per-row sampling and the shared prefix cache.

References are independent of the engine: the single-sequence ``stream_generate`` (its own
cache and loop), a full forward pass without any cache, and numpy formulas."""

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map

import mlx_tfm
from mlx_tfm import generate
from mlx_tfm import load, stream_generate
from mlx_tfm.engine.batch_cache import BATCH_CACHES, BatchCache, BatchKVCache, layer_windows
from mlx_tfm.model.cache import CausalRows, KVCache
from mlx_tfm.cpu import generic_routes
from mlx_tfm.engine.loop import Engine, batch_generate
from mlx_tfm.engine.scheduler import chunk_length
from mlx_tfm.engine.requests import Request, SamplingParams
from mlx_tfm.errors import UserError
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.engine.prefix_cache import PrefixCache
from mlx_tfm.generation.sampling import (SamplingRows, make_logits_processors, make_presence_frequency_penalty,
                                         sample_rows)

PROMPTS = [
    "Once upon a time", "The cat", "Lily and Tom went to the park. They", "One day", "Tom had a big red ball.",
    "The sun was", "A little bird", "Sue and her mom", "The dog ran to", "Ben liked to", "It was a sunny day. The",
    "Max", "The girl saw a", "In the garden there was a small", "Mom said", "The boy and the girl were",
]


@pytest.fixture(scope="module")
def stories(stories_hf):
    return load(stories_hf)


def tiny_model(seed: int = 0, **overrides) -> Model:
    """A random model on the stories tokenizer's 512 ids."""
    config = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 6,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256, **overrides}
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    # larger weights than at initialisation, so the logits have clear margins
    model.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


class Collector:
    """Events per request id, checked for the engine's promises as they arrive."""

    def __init__(self):
        self.events: dict[int, list] = {}
        self.threads: set[str] = set()

    def __call__(self, key):
        def on_event(event):
            events = self.events.setdefault(key, [])
            assert not events or events[-1].finish_reason is None, "an event after the final one"
            events.append(event)
            self.threads.add(threading.current_thread().name)
        return on_event

    def text(self, key) -> str:
        return "".join(e.text for e in self.events[key])

    def tokens(self, key) -> list[int]:
        return [e.token for e in self.events[key] if e.token is not None]

    def last(self, key):
        return self.events[key][-1]


def run_until_done(engine: Engine, limit: int = 10_000) -> int:
    steps = 0
    while engine.step():
        steps += 1
        assert steps < limit
    return steps


def reference_tokens(model, tokenizer, prompt, max_tokens, **kwargs) -> tuple[list[int], str, str]:
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs))
    return [r.token for r in responses], "".join(r.text for r in responses), responses[-1].finish_reason


# -- the batched cache against the model without any cache -----------------------------------


def full_forward_logits(model, tokens: list[int]) -> np.ndarray:
    """Logits of the last position from one forward pass without a cache: (V,)."""
    return np.array(model(mx.array(tokens)[None])[0, -1].astype(mx.float32))


@pytest.mark.parametrize("variant", [
    {}, {"position_embedding": "learned"}, {"position_embedding": "sinusoidal"},
    {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
])
def test_batched_logits_equal_single_row_logits(variant):
    """Rows of different lengths, prefilled in chunks of equal length per step and then
    decoded together, give every row the logits of its own tokens run alone."""
    model = tiny_model(**variant)
    windows = layer_windows(model, None)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(3, 512, size=n).tolist() for n in (3, 9, 14, 1)]
    # each row starts alone (its first tokens in its own cache), then they join one batch
    batch = [BatchKVCache(w) for w in windows]
    for seq in sequences:
        row = [BatchKVCache.for_row(None, None, 0, w) for w in windows]
        if len(seq) > 1:
            model(mx.array(seq[:-1])[None], cache=row)
        for layer, joined in zip(batch, row):
            layer.extend(joined)
    inputs = [seq[-1] for seq in sequences]
    for step in range(12):
        logits = np.array(model(mx.array(inputs)[:, None], cache=batch)[:, -1])
        for i, seq in enumerate(sequences):
            expected = full_forward_logits(model, seq)
            np.testing.assert_allclose(logits[i], expected, atol=2e-4, rtol=1e-4, err_msg=f"row {i} step {step}")
        inputs = [int(rng.integers(3, 512)) for _ in sequences]
        for seq, token in zip(sequences, inputs):
            seq.append(token)
        if step == 5:  # row 1 leaves, the rest go on compacted
            keep = [0, 2, 3]
            batch = [layer.select(keep) for layer in batch]
            sequences = [sequences[i] for i in keep]
            inputs = [inputs[i] for i in keep]


def prefill_group(model, windows, cached: list[list[int]]) -> list[BatchKVCache]:
    """One batched cache per layer whose rows each hold their own ``cached`` tokens (run
    alone first, as the prompt cache hands them over), joined right-aligned."""
    group = [BatchKVCache(w) for w in windows]
    for seq in cached:
        row = [BatchKVCache.for_row(None, None, 0, w) for w in windows]
        if seq:
            model(mx.array(seq)[None], cache=row)
        for layer, joined in zip(group, row):
            layer.extend(joined)
    return group


def test_a_prefill_group_of_unequal_rows_gives_exact_logits():
    """Several rows prefilled together in chunks (their caches of different lengths) attend
    only to their own positions."""
    model = tiny_model(seed=3)
    windows = layer_windows(model, None)
    rng = np.random.default_rng(1)
    cached = [rng.integers(3, 512, size=n).tolist() for n in (0, 7, 2)]
    group = prefill_group(model, windows, cached)
    chunk = rng.integers(3, 512, size=(3, 5))
    mask = group[0].make_mask(5)  # causal over rows that start at slots 7, 0 and 5
    assert isinstance(mask, CausalRows)
    slots, queries, starts = np.arange(12), np.arange(7, 12), np.array([7, 0, 5])
    expected = (slots[None, None, :] <= queries[None, :, None]) & (slots[None, None, :] >= starts[:, None, None])
    np.testing.assert_array_equal(np.array(mask.array(5)), expected[:, None])
    states = [(layer.keys, layer.values, layer.used, list(layer.starts), layer.offset) for layer in group]
    logits = np.array(model(mx.array(chunk), cache=group)[:, -1])
    for layer, (keys, values, used, starts_, offset) in zip(group, states):  # the same chunk again, as Metal runs it
        layer.keys, layer.values, layer.used, layer.starts, layer.offset = keys, values, used, starts_, offset
    with generic_routes():
        generic = np.array(model(mx.array(chunk), cache=group)[:, -1])
    for i, seq in enumerate(cached):
        expected_logits = full_forward_logits(model, seq + chunk[i].tolist())
        np.testing.assert_allclose(logits[i], expected_logits, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(generic[i], expected_logits, atol=2e-4, rtol=1e-4)
    assert group[0].make_mask(1).shape == (3, 1, 1, group[0].used + 1)


@pytest.mark.parametrize("variant", [
    {}, {"position_embedding": "learned"},
    {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
])
def test_a_padded_chunk_gives_each_row_the_logits_of_its_own_tokens(variant):
    """Rows with fewer prompt tokens left than the chunk pad it at their end; after
    ``drop_padding`` every row ends at the last slot again and the padding is never seen:
    the next tokens give each row the logits of its own tokens alone."""
    model = tiny_model(seed=4, **variant)
    windows = layer_windows(model, None)
    rng = np.random.default_rng(5)
    sequences = [rng.integers(3, 512, size=n).tolist() for n in (0, 7, 2, 4)]
    group = prefill_group(model, windows, sequences)
    feeds = [5, 2, 5, 1]  # real tokens per row; the chunk is 5 long
    chunk = [rng.integers(3, 512, size=n).tolist() + [0] * (5 - n) for n in feeds]
    model(mx.array(chunk), cache=group)
    for layer in group:
        layer.drop_padding([5 - n for n in feeds])
    for seq, row, n in zip(sequences, chunk, feeds):
        seq += row[:n]
    assert group[0].starts == [group[0].used - len(seq) for seq in sequences]
    np.testing.assert_array_equal(np.array(group[0].offset), [len(seq) for seq in sequences])
    for step in range(8):  # past the window of 6: the moved padding must stay out of it
        inputs = [int(rng.integers(3, 512)) for _ in sequences]
        for seq, token in zip(sequences, inputs):
            seq.append(token)
        logits = np.array(model(mx.array(inputs)[:, None], cache=group)[:, -1])
        for i, seq in enumerate(sequences):
            np.testing.assert_allclose(logits[i], full_forward_logits(model, seq), atol=2e-4, rtol=1e-4,
                                       err_msg=f"row {i} step {step}")


def test_chunk_length_pads_small_differences_and_never_a_short_row_much():
    assert chunk_length([99, 98, 97, 96], 512) == 99  # one pass, 6 padded positions of 396
    assert chunk_length([2000] + [50] * 10, 186) == 50  # padding 136 of each short row: no
    assert chunk_length([40, 30], 32) == 32  # capped by the step; the 30 pads 2
    assert chunk_length([3, 1], 512) == 1
    assert chunk_length([7], 4) == 4


def test_rows_joining_together_equal_rows_joining_one_at_a_time():
    """``extend`` with several caches (a prefill group admitted at once: one copy of each
    row) gives the slots, starts and offsets of joining them one by one."""
    rng = np.random.default_rng(2)
    rows = []
    for n in (0, 6, 3, 9):
        keys = mx.array(rng.normal(size=(1, 2, n, 4)).astype(np.float32)) if n else None
        values = mx.array(rng.normal(size=(1, 2, n, 4)).astype(np.float32)) if n else None
        rows.append(lambda keys=keys, values=values, n=n: BatchKVCache.for_row(keys, values, n + 1, None))
    together, one_by_one = BatchKVCache(), BatchKVCache()
    together.extend(*(make() for make in rows))
    for make in rows:
        one_by_one.extend(make())
    assert together.starts == one_by_one.starts == [9, 3, 6, 0] and together.used == one_by_one.used == 9
    np.testing.assert_array_equal(np.array(together.offset), np.array(one_by_one.offset))
    for a, b in ((together.keys, one_by_one.keys), (together.values, one_by_one.values)):
        np.testing.assert_array_equal(np.array(a[:, :, :9]), np.array(b[:, :, :9]))


class OwnKindCache(KVCache):
    """A single-sequence cache kind of its own, as a new layer kind would bring."""


class OnlyTheInterface(BatchCache):
    """A batched cache that serves the engine through ``BatchCache`` alone: its keys and
    values live in a hidden ``BatchKVCache`` the engine cannot see, and it takes no
    padding (as a recurrent state could not)."""

    takes_padding = False
    padded: list[list[int]] = []  # every drop_padding call's pads, over all instances

    def __init__(self, hidden: BatchKVCache | None = None):
        self._hidden = hidden if hidden is not None else BatchKVCache()

    @property
    def offset(self):
        return self._hidden.offset

    @property
    def size(self):
        return self._hidden.size

    def update_and_fetch(self, keys, values):  # what attention, this layer kind, calls
        return self._hidden.update_and_fetch(keys, values)

    def make_mask(self, length, window=None):
        return self._hidden.make_mask(length, window)

    def row_from(self, single, length):
        hidden = self._hidden.row_from(single, length)
        return None if hidden is None else OnlyTheInterface(hidden)

    def select(self, rows):
        return OnlyTheInterface(self._hidden.select(rows))

    def extend(self, *others):
        self._hidden.extend(*(other._hidden for other in others))

    def drop_padding(self, pads):
        OnlyTheInterface.padded.append(list(pads))
        self._hidden.drop_padding(pads)

    def holds_all(self, row, length):
        return self._hidden.holds_all(row, length)

    def export_row(self, row, into):
        self._hidden.export_row(row, into)

    @property
    def state(self):
        return self._hidden.state

    @property
    def nbytes(self):
        return self._hidden.nbytes


class OwnKindModel:
    """The stories model, its layers' caches of ``OwnKindCache``'s kind."""

    def __init__(self, model):
        self.model, self.args = model, model.args

    def __call__(self, inputs, cache=None):
        return self.model(inputs, cache=cache)

    def make_cache(self, max_kv_size=None):
        return [OwnKindCache() for _ in self.model.make_cache(max_kv_size=max_kv_size)]


def test_a_registered_batched_cache_kind_serves_the_engine_through_the_interface_alone(stories, monkeypatch):
    """The engine uses a layer's batched cache only through ``BatchCache``: a kind that is
    no ``BatchKVCache``, registered for its own single-sequence kind, batches prompts of
    unequal length (never padded: it takes no padding), decodes, and hands finished rows
    to the prompt cache and back, with the tokens of the model alone."""
    model, tokenizer = stories
    monkeypatch.setitem(BATCH_CACHES, OwnKindCache, lambda layer: OnlyTheInterface())
    monkeypatch.setattr(OnlyTheInterface, "padded", [])
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    engine = Engine(OwnKindModel(model), tokenizer, prefill_step_size=8)
    collector = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(Request(prompt, 20), collector(i))
    run_until_done(engine)
    engine.submit(Request(prompts[2], 20), collector("again"))
    run_until_done(engine)
    assert isinstance(engine._decode_cache[0], OnlyTheInterface)
    for i, prompt in enumerate(prompts):
        assert collector.tokens(i) == reference_tokens(model, tokenizer, prompt, 20)[0], f"prompt {i}"
    assert collector.tokens("again") == collector.tokens(2) and collector.last("again").cached_tokens > 0
    assert OnlyTheInterface.padded and not any(any(pads) for pads in OnlyTheInterface.padded)
    monkeypatch.delitem(BATCH_CACHES, OwnKindCache)
    with pytest.raises(UserError, match="no batched cache for layers whose cache is OwnKindCache"):
        Engine(OwnKindModel(model), tokenizer)


def test_windowed_batch_keeps_bounded_memory():
    cache = BatchKVCache(window=8)
    cache.step = 4
    for _ in range(50):
        cache.update_and_fetch(mx.zeros((2, 1, 1, 4)), mx.zeros((2, 1, 1, 4)))
    assert cache.used <= 8 - 1 + 4 and cache.keys.shape[2] <= 8 - 1 + 2 * 4


# -- greedy: alone == batched ----------------------------------------------------------------------


def test_greedy_alone_equals_a_batch_of_16_joining_at_different_steps(stories):
    model, tokenizer = stories
    max_tokens = 40
    expected = {i: reference_tokens(model, tokenizer, p, max_tokens) for i, p in enumerate(PROMPTS)}
    engine = Engine(model, tokenizer, max_batch=16, prefill_step_size=6)
    collector = Collector()
    join_at = {i: (i % 5) * 3 + i // 5 for i in range(len(PROMPTS))}  # steps 0..14
    steps = 0
    while True:
        for i, prompt in enumerate(PROMPTS):
            if join_at[i] == steps:
                engine.submit(Request(tokenizer.encode(prompt), max_tokens), collector(i))
        busy = engine.step()
        steps += 1
        if not busy and steps > max(join_at.values()):
            break
    for i in range(len(PROMPTS)):
        tokens, text, finish = expected[i]
        assert collector.tokens(i) == tokens, f"prompt {i}"
        assert collector.text(i) == text and collector.last(i).finish_reason == finish == "length"
        assert collector.last(i).generation_tokens == max_tokens
        assert collector.last(i).prompt_tokens == len(tokenizer.encode(PROMPTS[i]))


def test_running_streams_keep_flowing_while_a_long_prompt_is_read(stories, golden):
    model, tokenizer = stories
    engine = Engine(model, tokenizer, prefill_step_size=16)
    collector = Collector()
    engine.submit(Request([1], 100), collector("short"))
    for _ in range(3):
        engine.step()
    long_prompt = [1, *golden["generated_ids"][:150]]
    engine.submit(Request(long_prompt, 5), collector("long"))
    engine.step()
    produced = len(collector.events["short"])
    for _ in range(5):  # the long prompt takes ~10 chunks; the short stream gets a token each step
        engine.step()
    assert len(collector.events["short"]) == produced + 5 and "long" not in collector.events
    run_until_done(engine)
    assert collector.tokens("short") == golden["generated_ids"][:100]
    assert collector.tokens("long") == golden["generated_ids"][150:155]


def test_prompts_are_read_together_when_idle_and_within_the_step_while_streams_run(stories, golden):
    model, tokenizer = stories
    ids = golden["generated_ids"]
    prompts = [[1, *ids[i : i + 10]] for i in range(8)]  # 10 tokens each to prefill (the 11th is decoded)
    engine = Engine(model, tokenizer, prefill_step_size=20)
    collector = Collector()
    for i, p in enumerate(prompts[:4]):
        engine.submit(Request(p, 30), collector(i))
    engine.step()  # nothing was running: all four join, 20 tokens in all per pass (5 each)
    assert not engine._running and len(engine._prefilling) == 4 and all(r.fed == 5 for r in engine._prefilling)
    engine.step()  # the second half of each: decoding starts
    assert len(engine._running) == 4 and not engine._prefilling
    for i, p in enumerate(prompts[4:], start=4):
        engine.submit(Request(p, 30), collector(i))
    engine.step()  # streams are running: two prompts (20 tokens) per step
    assert len(engine._running) == 6 and len(engine._waiting) == 2
    run_until_done(engine)
    for i, p in enumerate(prompts):
        assert collector.tokens(i) == reference_tokens(model, tokenizer, p, 30)[0]


def test_prompts_of_unequal_length_are_read_in_one_pass(stories, golden):
    """A group whose prompts differ by a few tokens (a shared prefix from the prompt cache,
    or clients' prompts of different lengths) is read in one forward pass, each row padded
    to the longest, and decodes what each prompt decodes alone."""
    model, tokenizer = stories
    ids = golden["generated_ids"]
    prompts = [[1, *ids[i : i + n]] for i, n in enumerate((40, 37, 38, 35))]
    engine = Engine(model, tokenizer)
    collector = Collector()
    for i, p in enumerate(prompts):
        engine.submit(Request(p, 20), collector(i))
    engine.step()
    assert len(engine._running) == 4 and not engine._prefilling
    run_until_done(engine)
    for i, p in enumerate(prompts):
        assert collector.tokens(i) == reference_tokens(model, tokenizer, p, 20)[0]


class RecordingPositions(nn.Module):
    """A learned position table that remembers the largest position it was asked for."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table
        self.largest = -1

    def __call__(self, positions: mx.array) -> mx.array:
        self.largest = max(self.largest, int(positions.max()))
        return self.table(positions)


def test_padding_never_reaches_past_a_learned_position_table(stories):
    """A row near the end of the context (most of its prompt cached) in a group of rows with
    more to read: its padded positions stay inside the model's position table, and every
    row decodes what it decodes alone."""
    _, tokenizer = stories
    model = tiny_model(seed=6, position_embedding="learned", max_position_embeddings=32)
    rng = np.random.default_rng(7)
    long_prompt = rng.integers(3, 512, size=30).tolist()
    short_prompts = [rng.integers(3, 512, size=8).tolist() for _ in range(4)]
    expected = {key: reference_tokens(model, tokenizer, p, 2)[0]
                for key, p in [("long", long_prompt)] + list(enumerate(short_prompts))}
    engine = Engine(model, tokenizer)
    engine.submit(Request(long_prompt[:28], 1), Collector()("warm"))  # the prompt cache holds its first 28 tokens
    run_until_done(engine)
    recording = RecordingPositions(model.model.embed_positions)
    model.model.embed_positions = recording
    collector = Collector()
    engine.submit(Request(long_prompt, 2), collector("long"))
    for i, p in enumerate(short_prompts):
        engine.submit(Request(p, 2), collector(i))
    run_until_done(engine)
    assert engine.metrics()["prompt_cache_hits"] >= 1 and recording.largest < 32  # the table holds 0..31
    for key, tokens in expected.items():
        assert collector.tokens(key) == tokens, key


@pytest.mark.parametrize("variant", [
    {"position_embedding": "learned"}, {"position_embedding": "sinusoidal"},
    {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
])
def test_greedy_variants_alone_equal_batched(stories, variant):
    _, tokenizer = stories
    model = tiny_model(seed=5, **variant)
    prompts = [np.random.default_rng(i).integers(3, 512, size=n).tolist() for i, n in enumerate((4, 19, 11, 2))]
    expected = [reference_tokens(model, tokenizer, p, 24)[0] for p in prompts]
    engine = Engine(model, tokenizer, prefill_step_size=5)
    collector = Collector()
    for i, p in enumerate(prompts):
        engine.submit(Request(p, 24), collector(i))
    run_until_done(engine)
    assert [collector.tokens(i) for i in range(len(prompts))] == expected


def test_max_kv_size_rotates_like_the_single_sequence_cache(stories, golden):
    model, tokenizer = stories
    expected = reference_tokens(model, tokenizer, [1], 200, max_kv_size=64)[0]
    assert expected[:60] == golden["generated_ids"][:60] and expected != golden["generated_ids"]
    engine = Engine(model, tokenizer, max_kv_size=64)
    collector = Collector()
    engine.submit(Request([1], 200), collector("a"))
    for _ in range(30):
        engine.step()
    engine.submit(Request([1, *golden["generated_ids"][:20]], 150), collector("b"))
    run_until_done(engine)
    assert collector.tokens("a") == expected
    assert collector.tokens("b") == reference_tokens(model, tokenizer, [1, *golden["generated_ids"][:20]], 150,
                                                     max_kv_size=64)[0]
    assert engine._decode_cache[0].keys is None or engine._decode_cache[0].keys.shape[2] <= 64 + 256


def test_a_prompt_longer_than_the_context_is_an_error_event(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request([1] * 600, 5), collector("long"))
    engine.submit(Request([1], 5), collector("ok"))
    run_until_done(engine)
    (event,) = collector.events["long"]
    assert event.finish_reason == "error" and event.token is None
    assert "600 tokens" in event.error and "context is 512" in event.error and "\n" not in event.error
    assert collector.last("ok").finish_reason == "length"


def test_generation_stops_at_the_context(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request([1] * 500, 100), collector("a"))
    run_until_done(engine)
    assert collector.last("a").finish_reason == "length" and collector.last("a").generation_tokens == 12


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(prompt=[], max_tokens=5), "the prompt is empty"),
    (dict(prompt=[1, 600], max_tokens=5), "outside the model's vocabulary of 512"),
    (dict(prompt=[1], max_tokens=0), "max_tokens must be at least 1"),
    (dict(prompt=[1], max_tokens=5, top_logprobs=21), "top_logprobs must be between 0 and 20"),
    (dict(prompt=[1], max_tokens=5, sampling=SamplingParams(temp=-1)), "invalid sampling settings: temp=-1"),
    (dict(prompt=[1], max_tokens=5, sampling=SamplingParams(top_p=2)), "top_p=2"),
    (dict(prompt=[1], max_tokens=5, sampling=SamplingParams(repetition_penalty=0)), "must be positive"),
])
def test_invalid_requests_get_one_error_event(stories, request_kwargs, message):
    model, tokenizer = stories
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request(**request_kwargs), collector("bad"))
    run_until_done(engine)
    (event,) = collector.events["bad"]
    assert event.finish_reason == "error" and message in event.error


def test_invalid_engine_settings_are_one_line_errors(stories):
    model, tokenizer = stories
    with pytest.raises(UserError, match="--max-batch"):
        Engine(model, tokenizer, max_batch=0)
    with pytest.raises(UserError, match="--max-kv-size must be at least 2"):
        Engine(model, tokenizer, max_kv_size=1)


# -- stopping per row ---------------------------------------------------------------------------


def test_stop_strings_eos_and_max_tokens_per_row(stories, golden):
    model, tokenizer = stories
    text = golden["text"]
    eos = next(iter(tokenizer.eos_token_ids))
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request([1], 200, stop_strings=("girl named",)), collector("stop"))
    engine.submit(Request([1], 200, stop_strings=("ball. She", "never said")), collector("stop2"))
    engine.submit(Request([1], 7), collector("length"))
    forced_eos = SamplingParams(logit_bias={eos: 100.0})
    engine.submit(Request([1], 50, sampling=forced_eos), collector("eos"))
    run_until_done(engine)
    assert collector.text("stop") == text[: text.index("girl named")]
    assert collector.text("stop2") == text[: text.index("ball. She")]
    assert collector.last("stop").finish_reason == collector.last("stop2").finish_reason == "stop"
    assert collector.last("length").finish_reason == "length" and collector.last("length").generation_tokens == 7
    assert collector.tokens("length") == golden["generated_ids"][:7]
    assert collector.tokens("eos") == [eos] and collector.text("eos") == ""
    assert collector.last("eos").finish_reason == "stop"


# -- sampling per row --------------------------------------------------------------------------


def test_seeded_sampling_is_the_same_alone_or_batched(stories):
    model, tokenizer = stories
    settings = [SamplingParams(temp=0.9, top_p=0.9, seed=1), SamplingParams(temp=1.2, top_k=20, seed=2),
                SamplingParams(temp=0.7, min_p=0.1, seed=3), SamplingParams(temp=1.0, seed=4),
                SamplingParams(), SamplingParams(temp=1.0, top_p=0.8, top_k=30, min_p=0.02, seed=5)]
    prompts = [PROMPTS[i] for i in range(len(settings))]
    alone = [batch_generate(model, tokenizer, [p], 40, s)[0] for p, s in zip(prompts, settings)]
    together = batch_generate(model, tokenizer, prompts, 40, settings)
    assert together == alone
    reversed_order = batch_generate(model, tokenizer, prompts[::-1], 40, settings[::-1], max_batch=3)
    assert reversed_order[::-1] == alone
    other_seed = batch_generate(model, tokenizer, [prompts[3]], 40, SamplingParams(temp=1.0, seed=5))[0]
    assert other_seed != alone[3]


def test_a_tie_at_the_kth_value_gives_the_same_tokens_from_generate_and_from_the_server(stories):
    """Every logit of this model is 0 and a logit bias lifts five tokens to a tie: top_k 3
    keeps exactly three of them, the lowest ids, in every path, so one seed gives the same
    tokens from ``stream_generate``, ``generate``, ``batch_generate`` and an engine request
    built as the server builds it."""
    from mlx_tfm.server.completions import sampling_of
    from mlx_tfm.server.protocol import CompletionRequest
    from mlx_tfm.server.settings import ServerSettings

    _, tokenizer = stories
    model = tiny_model(seed=6, tie_word_embeddings=False)
    model.lm_head.weight = mx.zeros_like(model.lm_head.weight)
    tied = [100, 101, 102, 103, 104]
    sampling = SamplingParams(temp=1.0, top_k=3, seed=11, logit_bias={token: 5.0 for token in tied})
    prompt = tokenizer.encode("Once upon a time")
    single = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=40, sampling=sampling)]
    assert set(single) == {100, 101, 102}  # 103 and 104 tie with them at the k-th value, and never come
    text = generate(model, tokenizer, prompt, max_tokens=40, temp=1.0, top_k=3, seed=11, logit_bias=sampling.logit_bias)
    assert batch_generate(model, tokenizer, [prompt], 40, sampling) == [text] and text == tokenizer.decode(single)
    fields = CompletionRequest(prompt=prompt, temperature=1.0, top_k=3, seed=11,
                               logit_bias={str(token): 5.0 for token in tied})
    server_sampling = sampling_of(fields, ServerSettings(model="tiny"), model.args.vocab_size, row=0)
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request(prompt, 40, server_sampling), collector("server"))
    engine.submit(Request(prompt, 40, dataclasses.replace(server_sampling, seed=12)), collector("other seed"))
    run_until_done(engine)
    assert collector.tokens("server") == single and collector.tokens("other seed") != single


def test_one_request_gives_the_same_tokens_from_generate_and_from_the_engine(stories):
    """The same ``SamplingParams`` (seeded draws, filters, penalties, bias) through the
    single-sequence loop and through a batch of the engine."""
    model, tokenizer = stories
    settings = [SamplingParams(temp=0.9, top_p=0.9, min_p=0.05, seed=1, presence_penalty=1.5, frequency_penalty=0.5),
                SamplingParams(temp=1.1, top_k=20, seed=2, repetition_penalty=1.5, logit_bias={5: -2.0}),
                SamplingParams(presence_penalty=2.0, frequency_penalty=1.0)]
    prompts = PROMPTS[:3]
    alone = [generate(model, tokenizer, p, max_tokens=40, sampling=s) for p, s in zip(prompts, settings)]
    assert batch_generate(model, tokenizer, prompts, 40, settings) == alone
    assert alone[2] != generate(model, tokenizer, prompts[2], max_tokens=40)  # the penalties act in generate too


def test_sample_rows_follows_each_rows_filters():
    """Each row's draws stay inside the set numpy allows, and a plain temperature row
    matches its softmax frequencies."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, size=(4, 50)).astype(np.float32)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    rows = [SamplingParams(temp=1.0, top_k=3), SamplingParams(temp=1.0, top_p=0.5),
            SamplingParams(temp=1.0, min_p=0.2), SamplingParams(temp=0.0)]
    settings = SamplingRows(rows)
    order = np.argsort(-logprobs, axis=-1)
    probs = np.exp(logprobs)
    allowed = [set(order[0, :3])]
    mass_above = np.cumsum(np.take_along_axis(probs[1], order[1], -1)) - np.take_along_axis(probs[1], order[1], -1)
    allowed.append(set(order[1][mass_above < 0.5]))
    allowed.append(set(np.nonzero(probs[2] >= 0.2 * probs[2].max())[0]))
    allowed.append({int(order[3, 0])})
    keys = mx.stack([mx.random.key(i) for i in range(4)])
    seen = [set() for _ in rows]
    for _ in range(300):
        tokens, keys = sample_rows(mx.array(logprobs), settings, keys)
        for i, t in enumerate(tokens.tolist()):
            seen[i].add(t)
    for i in range(4):
        assert seen[i] <= allowed[i], f"row {i}"
    assert seen[0] == allowed[0] and len(seen[2]) > 1

    # a two-token distribution at temperature 0.5: frequencies follow softmax(logits / 0.5)
    two = np.log(np.array([[0.7, 0.3]], np.float32))
    settings = SamplingRows([SamplingParams(temp=0.5)])
    key = mx.random.key(7)[None]
    draws = []
    for _ in range(2000):
        token, key = sample_rows(mx.array(two), settings, key)
        draws.append(token.item())
    expected = 0.7 ** 2 / (0.7 ** 2 + 0.3 ** 2)
    assert abs(draws.count(0) / len(draws) - expected) < 0.03


def test_top_logprobs_and_the_chosen_logprob_match_numpy(stories, stories_dir, golden):
    model, tokenizer = stories
    reference = np.load(stories_dir / "greedy_reference_logits_first32.npy")
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request([1], 20, logprobs=True, top_logprobs=5), collector("a"))
    engine.submit(Request([1, 5, 6], 4), collector("plain"))
    run_until_done(engine)
    for row, event in zip(reference, collector.events["a"]):
        expected = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert abs(event.logprob - expected[event.token]) < 1e-4
        best = np.argsort(-expected)[:5]
        assert [t for t, _ in event.top_logprobs] == list(best)
        np.testing.assert_allclose([v for _, v in event.top_logprobs], expected[best], atol=1e-4)
    assert all(e.logprob is None and e.top_logprobs is None for e in collector.events["plain"])


def test_penalties_and_logit_bias_per_row(stories, golden):
    """A row with penalties changes; its neighbour in the batch does not."""
    model, tokenizer = stories
    engine = Engine(model, tokenizer)
    collector = Collector()
    banned = golden["generated_ids"][0]
    engine.submit(Request([1], 60, SamplingParams(repetition_penalty=3.0, repetition_context_size=50)), collector("rep"))
    engine.submit(Request([1], 60, SamplingParams(presence_penalty=2.0, frequency_penalty=1.0)), collector("pf"))
    engine.submit(Request([1], 60, SamplingParams(logit_bias={banned: float("-inf")})), collector("bias"))
    engine.submit(Request([1], 60), collector("plain"))
    run_until_done(engine)
    plain = golden["generated_ids"][:60]
    assert collector.tokens("plain") == plain
    assert collector.tokens("rep") != plain and collector.tokens("pf") != plain
    assert collector.tokens("bias")[0] != banned
    assert len(set(collector.tokens("pf"))) > len(set(plain))


def test_logit_bias_rows_equal_each_alone(stories, golden):
    """Rows with their own logit biases (boosts, bans, none) in one batch: each row's tokens
    are stream_generate's alone with the same bias as a logits processor."""
    model, tokenizer = stories
    plain = golden["generated_ids"][:30]
    biases = [{plain[0]: float("-inf")}, {plain[2]: 5.0, plain[3]: -3.0}, {}, {100: 2.5, 7: -1.0}]
    engine = Engine(model, tokenizer)
    collector = Collector()
    for i, bias in enumerate(biases):
        engine.submit(Request([1], 30, SamplingParams(logit_bias=bias or None)), collector(str(i)))
    run_until_done(engine)
    for i, bias in enumerate(biases):
        expected, _, _ = reference_tokens(model, tokenizer, [1], 30, logits_processors=make_logits_processors(logit_bias=bias))
        assert collector.tokens(str(i)) == expected, f"row {i}"
    assert collector.tokens("2") == plain


def test_logit_bias_outside_the_vocabulary_is_the_request_s_error(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request([1], 5, SamplingParams(logit_bias={model.args.vocab_size: 1.0})), collector("bad"))
    engine.submit(Request([1], 5), collector("good"))
    run_until_done(engine)
    assert collector.events["bad"][-1].finish_reason == "error"
    assert "logit_bias" in collector.events["bad"][-1].error
    assert len(collector.tokens("good")) == 5


def test_presence_frequency_penalty_against_numpy():
    prompt = [5, 5, 9]
    generated = [3, 3, 3, 7]
    processor = make_presence_frequency_penalty(0.5, 0.25, len(prompt))
    logits = np.random.default_rng(0).normal(size=(1, 12)).astype(np.float32)
    out = np.array(processor(mx.array(prompt + generated), mx.array(logits)))
    expected = logits.copy()
    for token, n in ((3, 3), (7, 1)):
        expected[0, token] -= 0.5 + 0.25 * n
    np.testing.assert_allclose(out, expected, atol=1e-6)


# -- lifecycle ---------------------------------------------------------------------------------


def test_a_cancelled_row_is_gone_after_one_step(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer)
    collector = Collector()
    ids = [engine.submit(Request(tokenizer.encode(p), 100), collector(i)) for i, p in enumerate(PROMPTS[:3])]
    waiting = engine.submit(Request([1], 100), collector("waiting"))
    engine.max_batch = 3
    for _ in range(4):
        engine.step()
    assert engine.metrics()["running"] == 3 and engine.metrics()["waiting"] == 1
    engine.cancel(ids[1])
    engine.cancel(waiting)
    produced = len(collector.events[1])
    engine.step()
    assert engine.metrics()["running"] == 2 and engine.metrics()["waiting"] == 0
    assert len(engine._running) == 2 and engine._decode_cache[0].size == 2
    assert collector.last(1).finish_reason == "cancelled" and len(collector.events[1]) == produced + 1
    assert collector.last("waiting").finish_reason == "cancelled"
    run_until_done(engine)
    assert collector.last(0).finish_reason == collector.last(2).finish_reason == "length"
    assert engine.metrics()["requests_total"] == {"cancelled": 2, "length": 2}


def test_an_exception_in_a_step_fails_only_the_affected_requests(stories, golden):
    model, tokenizer = stories
    calls = []

    def breaks_on_the_third_call(tokens, logits):
        calls.append(tokens.size)
        if len(calls) == 3:
            raise RuntimeError("processor broke\nsecond line")
        return logits

    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request([1], 30, logits_processors=(breaks_on_the_third_call,)), collector("broken"))
    engine.submit(Request([1], 30), collector("fine"))
    run_until_done(engine)
    assert collector.last("broken").finish_reason == "error"
    assert collector.last("broken").error == "RuntimeError: processor broke"
    assert len(collector.tokens("broken")) == 2 and calls == [1, 2, 3]
    assert collector.tokens("fine") == golden["generated_ids"][:30]

    # a forward pass that raises fails the rows in it; the engine keeps serving
    poison = 77

    class Flaky:
        def __init__(self, model):
            self.model, self.args = model, model.args

        def __call__(self, inputs, cache=None):
            if inputs.shape[1] > 1 and poison in inputs.tolist()[0]:
                raise ValueError("bad chunk")
            return self.model(inputs, cache=cache)

        def make_cache(self, **kwargs):
            return self.model.make_cache(**kwargs)

    engine = Engine(Flaky(model), tokenizer, prompt_cache_bytes=0)
    collector = Collector()
    engine.submit(Request([1], 40), collector("running"))
    engine.step()
    engine.submit(Request([1, 5, poison, 9, 12], 5), collector("poisoned"))
    run_until_done(engine)
    assert collector.last("poisoned").finish_reason == "error" and collector.last("poisoned").error == "ValueError: bad chunk"
    assert collector.tokens("running") == golden["generated_ids"][:40]
    engine.submit(Request([1], 10), collector("after"))
    run_until_done(engine)
    assert collector.tokens("after") == golden["generated_ids"][:10]


# -- the shared prefix cache -----------------------------------------------------------------


def test_a_second_turn_reuses_the_first_and_answers_as_a_cold_run(stories):
    model, tokenizer = stories
    engine = Engine(model, tokenizer)
    collector = Collector()
    first = tokenizer.encode("Lily had a red ball. She liked to play with it every day.")
    engine.submit(Request(first, 30), collector("turn1"))
    run_until_done(engine)
    second = first + collector.tokens("turn1") + tokenizer.encode("Then her friend Tom came.", add_special_tokens=False)
    engine.submit(Request(second, 30), collector("turn2"))
    run_until_done(engine)
    cold = Engine(model, tokenizer, prompt_cache_bytes=0)
    cold_collector = Collector()
    cold.submit(Request(second, 30), cold_collector("turn2"))
    run_until_done(cold)
    # the cache holds the first prompt and the answer tokens fed back (the last one too when
    # the engine had queued one more step)
    assert len(first) + 29 <= collector.last("turn2").cached_tokens <= len(first) + 30
    assert cold_collector.last("turn2").cached_tokens == 0
    assert collector.tokens("turn2") == cold_collector.tokens("turn2")
    assert collector.tokens("turn2") == reference_tokens(model, tokenizer, second, 30)[0]
    metrics = engine.metrics()
    assert metrics["prompt_cache_hits"] == 1 and metrics["prompt_cache_misses"] == 1
    assert 0 < metrics["prompt_cache_bytes"] <= 1 << 30
    assert metrics["generation_tokens_total"] == 60 and metrics["prompt_tokens_total"] == len(first) + len(second)
    assert metrics["requests_total"] == {"length": 2} and metrics["running"] == metrics["waiting"] == 0
    assert metrics["generation_tps"] > 0


def test_one_conversation_never_leaks_into_another(stories):
    """A shared system prompt is reused up to exactly the shared tokens; the rest of each
    conversation is its own."""
    model, tokenizer = stories
    system = tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    a = system + tokenizer.encode(" She had a big dog named Max.", add_special_tokens=False)
    b = system + tokenizer.encode(" She lived in a small house.", add_special_tokens=False)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    engine = Engine(model, tokenizer)
    collector = Collector()
    engine.submit(Request(a, 40), collector("a"))
    run_until_done(engine)
    engine.submit(Request(b, 40), collector("b"))
    engine.submit(Request(a, 40), collector("a again"))
    run_until_done(engine)
    assert collector.last("b").cached_tokens == shared >= len(system) - 1
    assert collector.tokens("b") == reference_tokens(model, tokenizer, b, 40)[0]
    assert collector.last("a again").cached_tokens == len(a) - 1
    assert collector.tokens("a again") == collector.tokens("a")


def test_lru_eviction_keeps_the_byte_bound(stories):
    model, tokenizer = stories
    entry_bytes = []

    def entry(tokens):
        cache = TokenCache(model)
        model(mx.array(tokens)[None], cache=cache.layers)
        cache.record(tokens)
        entry_bytes.append(cache.nbytes)
        return cache

    one = entry(list(range(3, 23)))
    bound = int(one.nbytes * 2.5)
    pool = PrefixCache(bound)
    pool.insert(one)
    pool.insert(entry(list(range(100, 120))))
    assert pool.lookup(list(range(3, 10)), limit=100)[1] == 7  # touch the first: now most recent
    pool.insert(entry(list(range(200, 220))))  # over the bound: the least recently used goes
    assert len(pool) == 2 and pool.nbytes <= bound
    assert pool.lookup(list(range(100, 120)), limit=100) == (None, 0)
    assert pool.lookup(list(range(3, 23)), limit=19)[1] == 19
    pool.insert(entry(list(range(3, 30))))  # extends an entry: replaces it
    assert len(pool) == 2 and pool.nbytes == sum(e.nbytes for e in pool.entries.values())
    pool.insert(entry(list(range(3, 8))))  # a prefix of a kept entry: adds nothing
    assert len(pool) == 2

    engine = Engine(model, tokenizer, prompt_cache_bytes=60_000)
    collector = Collector()
    for i, p in enumerate(PROMPTS):
        engine.submit(Request(tokenizer.encode(p), 20), collector(i))
        run_until_done(engine)
        assert engine.metrics()["prompt_cache_bytes"] <= 60_000
    assert len(engine.prefix_cache) >= 1


# -- threads ------------------------------------------------------------------------------------


def test_the_engine_thread_serves_concurrent_submitters_and_stops(stories):
    model, tokenizer = stories
    expected = {i: reference_tokens(model, tokenizer, p, 20)[0] for i, p in enumerate(PROMPTS[:8])}
    engine = Engine(model, tokenizer)
    engine.start()
    assert engine.ready
    collector = Collector()
    submitters = [threading.Thread(target=engine.submit, args=(Request(tokenizer.encode(p), 20), collector(i)))
                  for i, p in enumerate(PROMPTS[:8])]
    for t in submitters:
        t.start()
    deadline = time.time() + 60
    while len([k for k, e in collector.events.items() if e[-1].finish_reason]) < 8:
        assert time.time() < deadline
        time.sleep(0.01)
    assert {i: collector.tokens(i) for i in range(8)} == expected
    assert collector.threads == {"mlx-tfm-engine"}
    engine.submit(Request([1], 400), collector("long"))
    while "long" not in collector.events:
        time.sleep(0.01)
    engine.stop()
    assert not engine.ready
    assert collector.last("long").finish_reason == "error" and collector.last("long").error == "server shutting down"
    after = []
    engine.submit(Request([1], 5), after.append)
    assert after[0].finish_reason == "error"


def test_a_process_that_ran_the_engine_thread_exits_cleanly(stories_hf):
    """MLX crashes at exit when a thread that used mx.compile ends without freeing its
    streams (about half the runs without the fix)."""
    script = textwrap.dedent(f"""
        import time
        from mlx_tfm import load
        from mlx_tfm.engine.loop import Engine, Request
        model, tokenizer = load({str(stories_hf)!r})
        engine = Engine(model, tokenizer)
        engine.start()
        events = []
        engine.submit(Request([1], 8), events.append)
        while not events or events[-1].finish_reason is None:
            time.sleep(0.01)
        engine.stop()
    """)
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]


# -- the Python API -------------------------------------------------------------------------


def test_batch_generate_equals_generate(stories):
    model, tokenizer = stories
    texts = mlx_tfm.batch_generate(model, tokenizer, PROMPTS[:5], max_tokens=[10, 20, 30, 5, 25])
    assert texts == [generate(model, tokenizer, p, max_tokens=n) for p, n in zip(PROMPTS[:5], [10, 20, 30, 5, 25])]
    with pytest.raises(UserError, match="2 prompts need 2 max_tokens"):
        batch_generate(model, tokenizer, PROMPTS[:2], max_tokens=[1, 2, 3])
    with pytest.raises(UserError, match="prompt 1: the prompt holds token ids outside"):
        batch_generate(model, tokenizer, [[1, 2], [1, 9999]], max_tokens=3)
