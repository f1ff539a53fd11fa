"""The generation loop, through the Python API, on stories260K and tiny random models."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_tfm import generate
from mlx_tfm import load, stream_generate
from mlx_tfm.errors import UserError
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.generation.sampling import SamplingParams, make_logits_processors, make_sampler
from mlx_tfm.generation.settings import GenerationSettings
from fixtures.model_folders import tiny_llama_config, write_model_folder


@pytest.fixture(scope="module")
def stories(stories_hf):
    return load(stories_hf)


def tokens_of(responses):
    return [r.token for r in responses]


# -- golden output -----------------------------------------------------------------------


def test_greedy_from_bos_reproduces_the_golden_text(stories, golden):
    model, tokenizer = stories
    assert generate(model, tokenizer, golden["prompt_ids"], max_tokens=200) == golden["text"]
    responses = list(stream_generate(model, tokenizer, "", max_tokens=200))  # "" -> BOS only
    assert tokens_of(responses) == golden["generated_ids"]
    assert "".join(r.text for r in responses) == golden["text"]
    assert [r.finish_reason for r in responses[-2:]] == [None, "length"]
    assert responses[-1].generation_tokens == 200 and responses[-1].prompt_tokens == 1
    assert responses[-1].prompt_tps > 0 and responses[-1].generation_tps > 0 and responses[-1].peak_memory > 0


def test_chunked_prefill_and_prompt_continuation_match_the_golden_ids(stories, golden):
    model, tokenizer = stories
    ids = golden["generated_ids"]
    prompt = [1, *ids[:50]]
    for step in (3, 7, 512):
        responses = stream_generate(model, tokenizer, prompt, max_tokens=20, prefill_step_size=step)
        assert tokens_of(responses) == ids[50:70]


def test_text_prompt_continues_with_its_leading_space(stories, golden):
    model, tokenizer = stories
    text = generate(model, tokenizer, "Once upon a time,", max_tokens=5)
    assert text.startswith(" there") and golden["text"].startswith("Once upon a time," + text)


def test_cache_holds_the_prompt_and_every_yielded_token(stories, golden):
    """After the generator stops (closed early or finished) the cache covers prompt + all
    yielded tokens, so a next turn continues exactly where the text left off."""
    model, tokenizer = stories
    ids = golden["generated_ids"]
    cache = model.make_cache()
    stream = stream_generate(model, tokenizer, [1], max_tokens=100, prompt_cache=cache)
    first = [next(stream).token for _ in range(10)]
    stream.close()
    assert first == ids[:10] and cache[0].offset == 1 + 10
    # the next "turn" gives only the new token; the cache supplies the rest
    second = tokens_of(stream_generate(model, tokenizer, [ids[10]], max_tokens=15, prompt_cache=cache))
    assert second == ids[11:26] and cache[0].offset == 1 + 10 + 1 + 15


def test_generation_allocates_only_the_cache_it_can_fill(stories, golden):
    """The cache is told prompt + max_tokens, so a short generation holds no unused slots
    (the step is 256); a second turn grows it again and continues exactly."""
    model, tokenizer = stories
    ids = golden["generated_ids"]
    cache = model.make_cache()
    assert tokens_of(stream_generate(model, tokenizer, [1], max_tokens=20, prompt_cache=cache)) == ids[:20]
    assert all(c.keys.shape[2] == c.offset == 1 + 20 for c in cache)
    assert tokens_of(stream_generate(model, tokenizer, [ids[20]], max_tokens=5, prompt_cache=cache)) == ids[21:26]
    assert all(c.keys.shape[2] == c.offset == 1 + 20 + 1 + 5 for c in cache)


def test_rotating_cache_generates_past_the_context(stories, golden):
    model, tokenizer = stories
    responses = list(stream_generate(model, tokenizer, [1], max_tokens=600, max_kv_size=128))
    assert len(responses) == 600 and responses[-1].finish_reason == "length"
    assert tokens_of(responses[:120]) == golden["generated_ids"][:120]  # identical until the window fills


def test_without_rotating_cache_generation_stops_at_the_context(stories):
    model, tokenizer = stories
    responses = list(stream_generate(model, tokenizer, [1], max_tokens=1000))
    assert len(responses) == model.args.max_position_embeddings - 1
    assert responses[-1].finish_reason == "length"


# -- stopping ----------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["Lily", "girl named", "ball. She", "\n"])
def test_stop_strings_end_the_text_before_them(stories, golden, stop):
    model, tokenizer = stories
    responses = list(stream_generate(model, tokenizer, [1], max_tokens=200, stop_strings=["never said", stop]))
    text = "".join(r.text for r in responses)
    assert text == golden["text"][: golden["text"].index(stop)]
    assert responses[-1].finish_reason == "stop"


def test_eos_token_stops_and_is_not_shown(stories, golden):
    model, tokenizer = stories
    ids = golden["generated_ids"]
    saved = tokenizer.eos_token_ids
    tokenizer.eos_token_ids = {ids[5]}  # pretend the 6th token is EOS
    try:
        cache = model.make_cache()
        responses = list(stream_generate(model, tokenizer, [1], max_tokens=50, prompt_cache=cache))
    finally:
        tokenizer.eos_token_ids = saved
    assert tokens_of(responses) == ids[:6] and responses[-1].finish_reason == "stop"
    assert "".join(r.text for r in responses) == tokenizer.decode(ids[:5])
    assert cache[0].offset == 1 + 6


# -- probabilities and sampling ----------------------------------------------------------


def test_logprobs_are_normalised_and_greedy_picks_their_argmax(stories):
    model, tokenizer = stories
    for response in stream_generate(model, tokenizer, "Once upon", max_tokens=10):
        logprobs = np.array(response.logprobs)
        assert logprobs.shape == (model.args.vocab_size,)
        assert abs(np.exp(logprobs.astype(np.float64)).sum() - 1) < 1e-4
        assert response.token == int(np.argmax(logprobs))


def test_logprobs_match_the_reference_logits(stories, stories_dir, golden):
    model, tokenizer = stories
    reference = np.load(stories_dir / "greedy_reference_logits_first32.npy")
    responses = list(stream_generate(model, tokenizer, [1], max_tokens=31))
    for row, response in zip(reference, responses):
        expected = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert np.allclose(np.array(response.logprobs), expected, atol=1e-4)


def test_logit_bias_in_the_loop_picks_the_runner_up(stories, stories_dir, golden):
    model, tokenizer = stories
    first_logits = np.load(stories_dir / "greedy_reference_logits_first32.npy")[0]
    banned = golden["generated_ids"][0]
    processors = make_logits_processors(logit_bias={banned: float("-inf")})
    (response,) = stream_generate(model, tokenizer, [1], max_tokens=1, logits_processors=processors)
    assert response.token == int(np.argsort(-first_logits)[1])


def test_repetition_penalty_in_the_loop_changes_repeats(stories, golden):
    model, tokenizer = stories
    processors = make_logits_processors(repetition_penalty=3.0, repetition_context_size=50)
    tokens = tokens_of(stream_generate(model, tokenizer, [1], max_tokens=60, logits_processors=processors))
    plain = golden["generated_ids"][:60]

    def repeats(ids):  # tokens that already occurred in the previous 50
        return sum(t in ids[max(0, i - 50) : i] for i, t in enumerate(ids))

    assert tokens != plain and repeats(tokens) < repeats(plain)


def test_seeded_sampling_is_reproducible(stories):
    model, tokenizer = stories
    sampler = make_sampler(temp=1.0, top_p=0.95)

    def sample(seed):
        mx.random.seed(seed)
        return tokens_of(stream_generate(model, tokenizer, [1], max_tokens=40, sampler=sampler))

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_a_seed_in_the_sampling_settings_is_the_generation_s_own_random_stream(stories):
    """``seed=`` draws from its own key: the global random state, seeded or drawn from in
    between, changes nothing; another seed changes the tokens."""
    model, tokenizer = stories

    def sample(seed, global_seed):
        mx.random.seed(global_seed)
        mx.random.uniform()
        return tokens_of(stream_generate(model, tokenizer, [1], max_tokens=40, temp=1.0, top_p=0.95, seed=seed))

    assert sample(11, 0) == sample(11, 1)
    assert sample(11, 0) != sample(12, 0)


# -- the settings object -------------------------------------------------------------------


def test_settings_object_and_keywords_give_the_same_generation(stories, golden):
    model, tokenizer = stories
    settings = GenerationSettings(max_tokens=12, sampling=SamplingParams(repetition_penalty=3.0), stop_strings=("xyz",))
    by_object = tokens_of(stream_generate(model, tokenizer, [1], settings))
    by_keywords = tokens_of(stream_generate(model, tokenizer, [1], max_tokens=12, repetition_penalty=3.0,
                                            stop_strings=["xyz"]))
    mlx_lm_style = tokens_of(stream_generate(model, tokenizer, [1], max_tokens=12, stop_strings=["xyz"],
                                             logits_processors=make_logits_processors(repetition_penalty=3.0)))
    assert by_object == by_keywords == mlx_lm_style != golden["generated_ids"][:12]
    assert len(by_object) == 12
    assert tokens_of(stream_generate(model, tokenizer, [1], settings, max_tokens=3)) == by_object[:3]  # keywords win
    assert generate(model, tokenizer, [1], settings=settings) == generate(model, tokenizer, [1], False, settings)


def test_a_bad_keyword_or_setting_is_named(stories):
    model, tokenizer = stories
    with pytest.raises(TypeError, match="'max_token'"):
        list(stream_generate(model, tokenizer, [1], max_token=5))
    with pytest.raises(TypeError, match="settings must be a GenerationSettings"):
        list(stream_generate(model, tokenizer, [1], 5))
    with pytest.raises(ValueError, match="either a sampler or a sampling temperature"):
        list(stream_generate(model, tokenizer, [1], sampler=make_sampler(), temp=0.5))
    with pytest.raises(UserError, match="invalid sampling settings: temp=-1"):
        generate(model, tokenizer, [1], temp=-1)
    with pytest.raises(UserError, match="logit_bias names token ids outside the model's vocabulary of 512"):
        generate(model, tokenizer, [1], logit_bias={512: 1.0})


# -- prompt cache files ------------------------------------------------------------------


def continuation(model, tokenizer, prompt, cache=None):
    return tokens_of(stream_generate(model, tokenizer, prompt, max_tokens=30, prompt_cache=cache))


def test_prompt_cache_file_gives_the_same_continuation(stories, tmp_path):
    model, tokenizer = stories
    path = tmp_path / "prompt.safetensors"
    prompt = tokenizer.encode("Once upon a time, there was a big dog named Max. Max liked to run in the sun.")
    expected = continuation(model, tokenizer, prompt)

    token_cache = TokenCache(model)
    rest = token_cache.prepare(prompt)  # nothing cached: everything to do
    assert rest == prompt and token_cache.offset == 0
    assert continuation(model, tokenizer, rest, token_cache.layers) == expected
    token_cache.reconcile(prompt + expected)
    assert token_cache.trim_to(len(prompt))
    token_cache.save(path)

    token_cache = TokenCache.load(path, model)
    rest = token_cache.prepare(prompt)
    assert rest == prompt[-1:] and token_cache.offset == len(prompt) - 1
    assert continuation(model, tokenizer, rest, token_cache.layers) == expected

    other = prompt[:12] + tokenizer.encode(" The cat sat on a mat.", add_special_tokens=False)
    token_cache = TokenCache.load(path, model)
    rest = token_cache.prepare(other)  # shares a 12-token prefix
    assert token_cache.offset == 12 and rest == other[12:] and token_cache.tokens == other[:12]
    assert continuation(model, tokenizer, rest, token_cache.layers) == continuation(model, tokenizer, other)


def saved_cache(model, tokenizer, path) -> None:
    token_cache = TokenCache(model)
    list(stream_generate(model, tokenizer, [1, 403], max_tokens=1, prompt_cache=token_cache.layers))
    token_cache.record([1, 403, 407])
    token_cache.save(path)


def test_prompt_cache_file_of_another_model_is_refused(stories, tmp_path):
    model, tokenizer = stories
    path = tmp_path / "prompt.safetensors"
    saved_cache(model, tokenizer, path)
    other = Model(ModelArgs.from_dict(tiny_llama_config(vocab_size=512)))
    with pytest.raises(UserError, match="different model"):
        TokenCache.load(path, other)


def test_prompt_cache_file_of_other_weights_or_adapters_is_refused(stories, stories_hf, tmp_path):
    """Same architecture and dtype, other weights: a fine-tune, or the same base with
    another LoRA adapter, or a fresh adapter whose B is zero but whose A differs."""
    from mlx_tfm.model.lora import apply_lora

    model, tokenizer = stories
    path = tmp_path / "prompt.safetensors"
    saved_cache(model, tokenizer, path)
    TokenCache.load(path, model)  # the same model: accepted
    changed, _ = load(stories_hf)
    changed.layers[3].mlp.down_proj.weight = changed.layers[3].mlp.down_proj.weight * 1.01
    with pytest.raises(UserError, match="different model, dtype or adapter"):
        TokenCache.load(path, changed)
    adapted, _ = load(stories_hf)
    adapted.freeze()
    apply_lora(adapted, num_layers=2, fine_tune_type="lora", rank=4, scale=10.0, dropout=0.0)
    mx.eval(adapted.parameters())
    with pytest.raises(UserError, match="different model, dtype or adapter"):
        TokenCache.load(path, adapted)


def test_rotating_cache_survives_prompt_cache_save_and_load(stories, tmp_path):
    """A bounded cache past its bound (wrapped: its slots out of time order) saves and
    loads into a cache that continues exactly as the original does."""
    model, tokenizer = stories
    path = tmp_path / "rotating.safetensors"
    prompt = tokenizer.encode("Once upon a time, there was a big dog named Max. Max liked to run in the sun. " * 2)
    token_cache = TokenCache(model, max_kv_size=24)
    generated = continuation(model, tokenizer, prompt, token_cache.layers)
    token_cache.reconcile(prompt + generated)
    assert token_cache.offset > 24 and not token_cache.layers[0].is_trimmable()
    token_cache.save(path)
    loaded = TokenCache.load(path, model, max_kv_size=24)
    assert loaded.tokens == token_cache.tokens
    for original, restored in zip(token_cache.layers, loaded.layers):
        assert (restored.offset, restored.max_size, restored.keep) == (original.offset, original.max_size, original.keep)
    following = [1, 403, 407, 5]
    assert continuation(model, tokenizer, following, loaded.layers) == continuation(
        model, tokenizer, following, token_cache.layers)


# -- bad input ---------------------------------------------------------------------------


def test_empty_prompt_is_a_user_error(stories):
    model, tokenizer = stories
    with pytest.raises(UserError, match="prompt is empty"):
        generate(model, tokenizer, [])


def test_prompt_longer_than_the_context_is_a_user_error(stories):
    model, tokenizer = stories
    with pytest.raises(UserError, match="context is 512"):
        generate(model, tokenizer, [1] * 600)
    assert len(generate(model, tokenizer, [1] * 600, max_tokens=3, max_kv_size=256)) > 0


def test_nan_logits_are_a_user_error(stories_hf, stories):
    model, tokenizer = load(stories_hf)
    model.model.norm.weight = mx.full(model.model.norm.weight.shape, float("nan"))
    with pytest.raises(UserError, match="NaN logits"):
        generate(model, tokenizer, [1], max_tokens=5)


def test_tokenizer_larger_than_the_model_vocabulary_is_a_user_error(stories_hf, tmp_path):
    folder = write_model_folder(tmp_path / "m", tiny_llama_config(vocab_size=256),
                                {"tokenizer.model": stories_hf / "tokenizer.model"})
    model, tokenizer = load(folder)
    with pytest.raises(UserError, match="tokenizer has 512 tokens but the model only 256"):
        generate(model, tokenizer, "Once")
