"""Llama 4's chunked attention in the batching engine: rows at different positions each
attend within their own chunks (counted from the row's position 0), so 8 requests of
different lengths batched give the tokens each gives alone and plain cache-free greedy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.hybrid_models import engine_tokens, reference_tokens, tiny_family_model

from mlx_tfm.engine.batch_cache import BatchKVCache
from mlx_tfm.engine.loop import Engine
from mlx_tfm.engine.requests import Request
from mlx_tfm.model.local_attention import chunk_mask
from mlx_tfm.tokenizer import load_tokenizer

# lengths 3..17 around the tiny model's chunk of 5 positions
PROMPTS = [[1, 5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11, 300, 7][: 3 + 2 * i] for i in range(8)]


@pytest.fixture(scope="module")
def llama4(stories_hf):
    model = tiny_family_model("llama4_text")
    assert model.args.attention_chunk_size == 5 and "chunked_attention" in model.args.layer_types
    return model, load_tokenizer(stories_hf)


@pytest.mark.parametrize("max_batch,prefill_step_size", [(8, 64), (3, 4)])
def test_eight_requests_batched_equal_each_alone_and_plain_greedy(llama4, max_batch, prefill_step_size):
    model, tokenizer = llama4
    together = engine_tokens(model, tokenizer, PROMPTS, 9, max_batch=max_batch, prefill_step_size=prefill_step_size)
    alone = [engine_tokens(model, tokenizer, [p], 9)[0] for p in PROMPTS]
    assert together == alone == [reference_tokens(model, tokenizer, p, 9) for p in PROMPTS]


def test_rows_joining_mid_run_keep_their_own_chunks(llama4):
    model, tokenizer = llama4
    engine = Engine(model, tokenizer, max_batch=8, prefill_step_size=6)
    tokens = {i: [] for i in range(len(PROMPTS))}
    for step in range(200):
        if step < len(PROMPTS):  # one new request per step, while the others decode
            engine.submit(Request(PROMPTS[step], 8), lambda e, i=step: tokens[i].append(e.token))
        if not engine.step() and step >= len(PROMPTS):
            break
    for i, prompt in enumerate(PROMPTS):
        assert [t for t in tokens[i] if t is not None] == reference_tokens(model, tokenizer, prompt, 8), f"prompt {i}"


def test_the_batched_chunked_mask_is_each_rows_own_chunk_mask():
    offsets, chunk, length = [7, 2, 11], 4, 3
    rows = [BatchKVCache.for_row(mx.zeros((1, 1, n, 2)), mx.zeros((1, 1, n, 2)), n, None) for n in offsets]
    cache = rows[0]
    cache.extend(*rows[1:])  # right-aligned: slot s of row b holds position offsets[b] - 11 + s
    mask = np.array(cache.make_mask(length, chunk=chunk))  # (3, 1, L, S)
    assert mask.shape == (3, 1, length, 11 + length)
    for b, n in enumerate(offsets):
        own = np.array(chunk_mask(mx.arange(n, n + length), mx.arange(n + length), chunk))  # (L, n + L)
        np.testing.assert_array_equal(mask[b, 0, :, 11 - n :], own)
        assert not mask[b, 0, :, : 11 - n].any()  # the slots before the row's data
