"""Recurrent layers (StateCache) through generation: chunked prefill, prompt-cache files,
--max-kv-size and --kv-bits touching only attention layers, TokenCache reuse and its
snapshots, and chat keeping the state between turns (/undo, regenerate). Every check
compares with the same model decoding greedily with no cache at all."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from fixtures.model_folders import with_chat_template
from fixtures.recurrent_models import tiny_lfm2, uncached_greedy_tokens

from mlx_tfm.chat.conversation import ChatSession, Settings
from mlx_tfm.errors import UserError
from mlx_tfm.generation.step import generate_step
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.model.cache import KVQuantization, KVCache, QuantizedKVCache, RotatingKVCache, quantized_layers
from mlx_tfm.model.state_cache import StateCache
from mlx_tfm.tokenizer import load_tokenizer

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]


@pytest.fixture(scope="module")
def model():
    return tiny_lfm2()


def decode(model, prompt, n, cache=None, **kwargs) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache, **kwargs)
    return [token for token, _ in steps]


@pytest.mark.parametrize("step", [1, 3, 512])
def test_chunked_prefill_folds_into_the_state(model, step):
    assert decode(model, PROMPT, 10, prefill_step_size=step) == uncached_greedy_tokens(model, PROMPT, 10)


def test_max_kv_size_bounds_only_the_attention_layers():
    from mlx_tfm.generation.step import context_room

    model = tiny_lfm2(max_position_embeddings=64)
    cache = model.make_cache(max_kv_size=4)
    assert [type(c) for c in cache] == [StateCache, RotatingKVCache, StateCache]
    assert context_room(model, cache, 280) is None  # a state and a rotating cache: any length fits
    with pytest.raises(UserError, match="context is 64"):
        context_room(model, model.make_cache(), 280)
    assert len(decode(model, PROMPT * 20, 5, cache=cache)) == 5


def test_kv_bits_quantizes_only_the_attention_layers():
    model = tiny_lfm2(num_attention_heads=1, num_key_value_heads=1)  # head_dim 32: one quantization group
    cache = quantized_layers(model.make_cache(), KVQuantization(8, 32, 0))
    assert [type(c) for c in cache] == [StateCache, QuantizedKVCache, StateCache]
    assert len(decode(model, PROMPT, 4, cache=cache)) == 4


def test_a_prompt_cache_file_round_trips_the_state(model, tmp_path):
    cache = TokenCache(model)
    feed = cache.feed_to_snapshot(cache.prepare(PROMPT))
    assert feed == PROMPT[-1:] and cache.tokens == PROMPT[:-1]
    cache.save(tmp_path / "prompt.safetensors")
    loaded = TokenCache.load(tmp_path / "prompt.safetensors", model)
    assert [type(c) for c in loaded.layers] == [StateCache, KVCache, StateCache]
    assert loaded.layers[0].offset == len(PROMPT) - 1
    assert decode(model, loaded.prepare(PROMPT), 8, cache=loaded.layers) == uncached_greedy_tokens(model, PROMPT, 8)


def test_a_prompt_cache_file_of_another_layout_is_refused(model, tmp_path):
    cache = TokenCache(model)
    cache.feed_to_snapshot(PROMPT)
    cache.save(tmp_path / "prompt.safetensors")
    attention_only = tiny_lfm2(layer_types=["full_attention"] * 3)
    with pytest.raises(UserError, match=r"prompt.safetensors holds a recurrent state for layer 0, but this model's "
                                        r"layer 0 keeps keys and values"):
        TokenCache.load(tmp_path / "prompt.safetensors", attention_only)


def test_prepare_reuses_a_state_only_when_the_target_extends_it(model):
    cache = TokenCache(model)
    decode(model, cache.prepare(PROMPT[:6]), 0, cache=cache.layers)  # feeds all 6
    cache.record(PROMPT[:6])
    assert cache.prepare(PROMPT) == PROMPT[6:]  # extends: only the rest is fed
    assert cache.prepare(PROMPT[:3] + [7, 7, 7]) == PROMPT[:3] + [7, 7, 7]  # diverges, no snapshot: from scratch
    assert cache.tokens == [] and cache.layers[0].offset == 0


def test_prepare_goes_back_to_the_longest_snapshot_in_the_common_prefix(model):
    cache = TokenCache(model)
    for piece in (PROMPT[:4], PROMPT[4:9], PROMPT[9:]):
        decode(model, piece, 0, cache=cache.layers)
        cache.record(piece)
        cache.snapshot()
    other = PROMPT[:11] + [99, 98]
    feed = cache.prepare(other)
    assert feed == other[9:] and cache.tokens == PROMPT[:9] and cache.layers[1].offset == 9
    assert decode(model, feed, 6, cache=cache.layers) == uncached_greedy_tokens(model, other, 6)
    assert sorted(cache.snapshots) == [4, 9]


def test_copy_keeps_the_state_apart(model):
    cache = TokenCache(model)
    decode(model, PROMPT, 0, cache=cache.layers)
    cache.record(PROMPT)
    twin = cache.copy()
    decode(model, [1, 2, 3], 0, cache=twin.layers)
    assert cache.layers[0].offset == len(PROMPT) and twin.layers[0].offset == len(PROMPT) + 3


# -- chat ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat(stories_hf, tmp_path_factory):
    folder = with_chat_template(stories_hf, tmp_path_factory.mktemp("chat") / "model")
    return tiny_lfm2(vocab_size=512), load_tokenizer(folder)


def uncached_answer(model, tokenizer, messages, n) -> str:
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    tokens = uncached_greedy_tokens(model, prompt, n)
    eos = [i for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids]
    return tokenizer.decode(tokens[: eos[0]] if eos else tokens)


def test_chat_keeps_the_state_between_turns_and_undo_regenerates(chat):
    model, tokenizer = chat
    session = ChatSession(model, tokenizer, Settings(max_tokens=8), on_notice=lambda text: None)
    first = "".join(session.answer("Once upon a time"))
    assert first == uncached_answer(model, tokenizer, session.conversation.messages()[:1], 8)
    second = "".join(session.answer("What then?"))
    assert session.last_stats.new_prompt_tokens < len(session.render(session.conversation.messages()[:3]))
    assert second == uncached_answer(model, tokenizer, session.conversation.messages()[:3], 8)
    assert session.undo()
    assert "".join(session.answer("What then?")) == second  # regenerated from the snapshot
    assert session.last_stats.new_prompt_tokens < 20
    assert {c.offset for c in session.cache.layers} == {len(session.cache.tokens)}


# -- speculative decoding ------------------------------------------------------------------


def speculative(model, drafter, prompt, n, k=3, cache=None):
    from mlx_tfm.generation.speculative import speculative_generate_step

    steps = speculative_generate_step(mx.array(prompt), model, drafter, num_draft_tokens=k, max_tokens=n,
                                      prompt_cache=cache)
    return [token for token, _ in steps]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_recurrent_draft_model_gives_plain_greedy_tokens(model, k):
    from mlx_tfm.generation.speculative import DraftModel

    draft = tiny_lfm2(seed=3)  # another model: many of its guesses are rejected
    drafter = DraftModel(draft, draft.make_cache(), model.args.vocab_size)
    assert speculative(model, drafter, PROMPT, 16, k) == uncached_greedy_tokens(model, PROMPT, 16)
    # rejections happen: the draft's own greedy text is not the model's
    assert uncached_greedy_tokens(draft, PROMPT, 16) != uncached_greedy_tokens(model, PROMPT, 16)


def test_the_model_itself_as_draft_keeps_every_guess(model):
    from mlx_tfm.generation.speculative import DraftModel

    drafter = DraftModel(model, model.make_cache(), model.args.vocab_size)
    assert speculative(model, drafter, PROMPT, 12) == uncached_greedy_tokens(model, PROMPT, 12)


def test_prompt_lookup_on_a_recurrent_model_gives_plain_greedy_tokens(model):
    from mlx_tfm.generation.speculative import PromptLookup

    prompt = PROMPT + PROMPT[:6] + PROMPT  # repeats: lookup finds guesses, some wrong
    assert speculative(model, PromptLookup(), prompt, 16, k=4) == uncached_greedy_tokens(model, prompt, 16)


@pytest.mark.parametrize("stop_after", [1, 2, 5])
def test_a_closed_speculative_run_leaves_prompt_and_yielded_tokens(model, stop_after):
    from mlx_tfm.generation.speculative import PromptLookup, speculative_generate_step

    prompt = PROMPT + PROMPT
    cache = model.make_cache()
    steps = speculative_generate_step(mx.array(prompt), model, PromptLookup(), num_draft_tokens=4, max_tokens=20,
                                      prompt_cache=cache)
    yielded = [token for token, _ in itertools.islice(steps, stop_after)]
    steps.close()
    assert {c.offset for c in cache} == {len(prompt) + stop_after}
    logits = model(mx.array([[7]]), cache=cache)[0, -1]
    fresh = model(mx.array([prompt + yielded + [7]]))[0, -1]
    assert mx.allclose(logits, fresh, atol=1e-4).item()


def test_chat_with_a_recurrent_draft_model_answers_as_plain_greedy(chat):
    model, tokenizer = chat
    draft = tiny_lfm2(seed=5, vocab_size=512)
    plain = ChatSession(model, tokenizer, Settings(max_tokens=8), on_notice=lambda text: None)
    fast = ChatSession(model, tokenizer, Settings(max_tokens=8), on_notice=lambda text: None, draft_model=draft,
                       num_draft_tokens=3)
    for message in ("Once upon a time", "What then?"):
        assert "".join(fast.answer(message)) == "".join(plain.answer(message))
    assert fast.undo() and plain.undo()
    assert "".join(fast.answer("And then?")) == "".join(plain.answer("And then?"))
    assert {c.offset for c in fast.draft_cache.layers} == {len(fast.draft_cache.tokens)}


def test_generate_cli_prompt_cache_file_of_an_lfm2_model(stories_hf, tmp_path):
    """``--prompt-cache-file``: the state is saved at the prompt (a snapshot, since it cannot
    be trimmed back from the answer), and the second run reads only the last prompt token."""
    import os
    import shutil
    import subprocess
    import sys

    from fixtures.convert_helpers import make_hf_model

    folder = tmp_path / "lfm2"
    make_hf_model("lfm2", folder, vocab_size=512)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(stories_hf / name, folder / name)
    cache_file = tmp_path / "prompt.safetensors"
    args = [sys.executable, "-m", "mlx_tfm", "generate", "--model", str(folder), "--prompt", "Once upon a time, there",
            "-m", "12"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    runs = [subprocess.run(args + extra, capture_output=True, text=True, env=env, timeout=120)
            for extra in ([], ["--prompt-cache-file", str(cache_file)], ["--prompt-cache-file", str(cache_file)])]
    assert [r.returncode for r in runs] == [0, 0, 0], runs[-1].stderr
    assert runs[0].stdout == runs[1].stdout == runs[2].stdout
    assert "Prompt: 1 tokens" in runs[2].stderr
