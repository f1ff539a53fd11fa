"""Every hybrid family once through the engine and generation: tiny random models of the
families whose layers are not all plain attention (recurrent mixers, Falcon-H1's parallel
state, MLA, Gemma 4's KV sharing, Llama 4's chunked attention) give plain cache-free
greedy tokens batched, alone, streamed in small prefill chunks and resumed from a
prompt-cache file."""

from __future__ import annotations

import mlx.core as mx
import pytest
from fixtures.hybrid_models import HYBRID_FAMILIES, engine_tokens, reference_tokens, tiny_family_model
from fixtures.recurrent_models import uncached_greedy_tokens

from mlx_tfm.engine.loop import batch_generate
from mlx_tfm.generation.step import generate_step, prefill
from mlx_tfm.generation.stream import stream_generate
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.tokenizer import load_tokenizer

LONG_PROMPT = [1, 5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11, 300, 7, 88, 123, 45, 67, 210]
PROMPTS = [LONG_PROMPT[: 3 + 4 * i] for i in range(4)]  # 3, 7, 11 and 15 tokens


@pytest.fixture(scope="module")
def tokenizer(stories_hf):
    return load_tokenizer(stories_hf)


@pytest.fixture(scope="module", params=list(HYBRID_FAMILIES))
def model(request):
    return tiny_family_model(HYBRID_FAMILIES[request.param])


def test_batch_generate_of_four_prompts_equals_each_alone_and_plain_greedy(model, tokenizer):
    together = engine_tokens(model, tokenizer, PROMPTS, 6, prefill_step_size=5)
    alone = [engine_tokens(model, tokenizer, [p], 6)[0] for p in PROMPTS]
    assert together == alone == [reference_tokens(model, tokenizer, p, 6) for p in PROMPTS]
    texts = batch_generate(model, tokenizer, PROMPTS, max_tokens=6, prefill_step_size=5)
    assert texts == [batch_generate(model, tokenizer, [p], max_tokens=6)[0] for p in PROMPTS]


def test_stream_generate_over_several_prefill_chunks_equals_plain_greedy(model, tokenizer):
    responses = list(stream_generate(model, tokenizer, LONG_PROMPT, max_tokens=8, prefill_step_size=4))
    expected = reference_tokens(model, tokenizer, LONG_PROMPT, 8)
    assert [r.token for r in responses] == expected


def test_a_prompt_cache_file_round_trip_resumes_as_plain_greedy(model, tmp_path):
    cache = TokenCache(model)
    prefill(model, mx.array(LONG_PROMPT[:-1]), cache.layers, step_size=5)
    cache.record(LONG_PROMPT[:-1])
    cache.save(tmp_path / "prompt.safetensors")
    loaded = TokenCache.load(tmp_path / "prompt.safetensors", model)
    assert [type(c) for c in loaded.layers] == [type(c) for c in model.make_cache()]
    rest = loaded.prepare(LONG_PROMPT)
    assert rest == LONG_PROMPT[-1:]  # every position the file holds is reused
    steps = generate_step(mx.array(rest), model, max_tokens=8, prompt_cache=loaded.layers)
    assert [token for token, _ in steps] == uncached_greedy_tokens(model, LONG_PROMPT, 8)
