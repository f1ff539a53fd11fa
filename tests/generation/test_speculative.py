"""Speculative decoding (mlx_tfm/generation/speculative.py): greedy output equals plain greedy decoding
token for token, sampled output follows the model's distribution (chi-square), the caches
end as plain decoding leaves them, and bad settings are one line."""

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
import pytest
from scipy import stats as scipy_stats

from mlx_tfm import load, stream_generate
from mlx_tfm.cli import main
from mlx_tfm.errors import UserError
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.generation.token_cache import TokenCache
from mlx_tfm.generation.sampling import make_sampler
from mlx_tfm.generation.speculative import (
    DraftModel,
    PromptLookup,
    SpeculationStats,
    accept_by_rejection,
    check_draft_tokenizer,
    lookup,
    speculative_generate_step,
    sync_draft_cache,
)
from mlx_tfm.tokenizer import load_tokenizer

from fixtures.draft_models import noisy_copy
from fixtures.model_folders import tiny_llama_config, write_model_folder
from fixtures.tokenizer_folders import byte_level_folder

# A prompt that repeats itself, so prompt lookup finds what to copy.
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")


@pytest.fixture(scope="module")
def stories(stories_hf):
    return load(stories_hf)


@pytest.fixture(scope="module")
def noisy_draft(stories_hf, tmp_path_factory):
    """stories260K with seeded noise (scale 0.1): keeps some guesses, rejects others."""
    return load(noisy_copy(stories_hf, tmp_path_factory.mktemp("draft") / "noisy", seed=7, scale=0.1))[0]


@pytest.fixture(scope="module")
def other_draft(stories_hf, tmp_path_factory):
    """stories260K's shape and tokenizer, other weights (scale 1.0): rejects almost every guess."""
    return load(noisy_copy(stories_hf, tmp_path_factory.mktemp("draft") / "other", seed=11, scale=1.0))[0]


def tokens_of(responses) -> list[int]:
    return [r.token for r in responses]


def plain(model, tokenizer, prompt, **kwargs) -> list:
    return list(stream_generate(model, tokenizer, prompt, **kwargs))


# -- greedy: token for token ---------------------------------------------------------------


def test_draft_of_itself_reproduces_the_golden_ids_and_keeps_every_guess(stories, golden):
    model, tokenizer = stories
    responses = plain(model, tokenizer, [1], max_tokens=200, draft_model=model, num_draft_tokens=4)
    assert tokens_of(responses) == golden["generated_ids"]
    assert responses[-1].accepted_tokens == responses[-1].drafted_tokens > 150


@pytest.mark.parametrize("num_draft_tokens", [1, 2, 5])
@pytest.mark.parametrize("draft", ["noisy_draft", "other_draft"])
def test_greedy_with_another_draft_equals_plain_greedy(stories, golden, draft, num_draft_tokens, request):
    model, tokenizer = stories
    responses = plain(model, tokenizer, [1], max_tokens=200, draft_model=request.getfixturevalue(draft),
                      num_draft_tokens=num_draft_tokens)
    assert tokens_of(responses) == golden["generated_ids"]
    last = responses[-1]
    assert "".join(r.text for r in responses) == golden["text"] and last.finish_reason == "length"
    # guesses were rejected (the rollback paths ran); the noisy copy's also kept
    assert last.accepted_tokens < last.drafted_tokens
    assert last.accepted_tokens > 0 or draft == "other_draft"


@pytest.mark.parametrize("num_tokens", [1, 3, 10])
def test_prompt_lookup_greedy_equals_plain_greedy(stories, num_tokens):
    model, tokenizer = stories
    prompt = STORY + " " + STORY[:40]
    expected = plain(model, tokenizer, prompt, max_tokens=120)
    responses = plain(model, tokenizer, prompt, max_tokens=120, prompt_lookup_num_tokens=num_tokens)
    assert tokens_of(responses) == tokens_of(expected)
    assert [r.text for r in responses] == [r.text for r in expected]
    assert 0 < responses[-1].accepted_tokens <= responses[-1].drafted_tokens


@pytest.mark.parametrize("step", [3, 7])
def test_chunked_prefill_with_a_draft(stories, noisy_draft, golden, step):
    model, tokenizer = stories
    ids = golden["generated_ids"]
    responses = plain(model, tokenizer, [1, *ids[:50]], max_tokens=40, prefill_step_size=step,
                      draft_model=noisy_draft, num_draft_tokens=3)
    assert tokens_of(responses) == ids[50:90]


def test_lookup_prefers_the_longest_then_the_latest_match():
    # "5 6 7" ends the text and occurred at 0 (then 8 1 6); "6 7" occurred later, at 5
    assert lookup(np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]), 3) == [8, 1, 6]
    # no earlier "4 6 7"; "6 7" occurred at 1 and at 5: the latest is copied
    assert lookup(np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 4, 6, 7]), 2) == [9, 2]
    assert lookup(np.array([3, 1, 2, 3]), 4) == [1, 2, 3]  # a guess may run up to the end
    assert lookup(np.array([1, 2, 3]), 4) == []
    assert lookup(np.array([3, 1, 2, 3]), 0) == []


# -- stops inside an accepted run ------------------------------------------------------------


def test_stop_string_inside_an_accepted_run_ends_where_plain_decoding_does(stories, golden):
    model, tokenizer = stories
    stop = ["red ball"]
    expected = plain(model, tokenizer, [1], max_tokens=200, stop_strings=stop)
    cache, draft_cache = model.make_cache(), model.make_cache()
    responses = plain(model, tokenizer, [1], max_tokens=200, stop_strings=stop, prompt_cache=cache,
                      draft_model=model, draft_cache=draft_cache, num_draft_tokens=6)
    assert tokens_of(responses) == tokens_of(expected) and len(responses) < 60
    assert "".join(r.text for r in responses) == "".join(r.text for r in expected)
    assert responses[-1].finish_reason == "stop"
    # the stop came mid-run: later guesses were accepted too, and rolled back
    assert cache[0].offset == draft_cache[0].offset == 1 + len(responses)


def test_eos_inside_an_accepted_run_ends_where_plain_decoding_does(stories, golden, monkeypatch):
    model, tokenizer = stories
    ids = golden["generated_ids"]
    monkeypatch.setattr(tokenizer, "eos_token_ids", {ids[33]})  # as if that token were EOS
    expected = plain(model, tokenizer, [1], max_tokens=200)
    assert tokens_of(expected) == ids[: ids.index(ids[33]) + 1]
    for kwargs in (dict(draft_model=model, num_draft_tokens=5), dict(prompt_lookup_num_tokens=5)):
        cache = model.make_cache()
        responses = plain(model, tokenizer, [1], max_tokens=200, prompt_cache=cache, **kwargs)
        assert tokens_of(responses) == tokens_of(expected)
        assert responses[-1].finish_reason == "stop" and cache[0].offset == 1 + len(responses)


# -- the caches --------------------------------------------------------------------------------


def layer_states(cache) -> list[np.ndarray]:
    return [np.array(x) for layer in cache for x in layer.state]


def test_caches_after_rejections_equal_the_caches_of_plain_decoding(stories, noisy_draft, golden):
    """Speculation feeds guesses in chunks and trims the rejected ones; what stays must be
    what one-token-at-a-time decoding computes (within float32 rounding of chunked products)."""
    model, tokenizer = stories
    n = 57  # ends mid-run
    plain_cache = model.make_cache()
    expected = tokens_of(plain(model, tokenizer, [1], max_tokens=n, prompt_cache=plain_cache))
    cache, draft_cache = model.make_cache(), noisy_draft.make_cache()
    responses = plain(model, tokenizer, [1], max_tokens=n, prompt_cache=cache, draft_model=noisy_draft,
                      draft_cache=draft_cache, num_draft_tokens=4)
    assert tokens_of(responses) == expected and 0 < responses[-1].accepted_tokens < responses[-1].drafted_tokens
    assert cache[0].offset == plain_cache[0].offset == 1 + n
    for ours, theirs in zip(layer_states(cache), layer_states(plain_cache)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    # the draft's cache holds the same tokens, as its own plain prefill of them computes
    reference = noisy_draft.make_cache()
    noisy_draft(mx.array([[1, *expected]]), cache=reference)
    assert draft_cache[0].offset == 1 + n
    for ours, theirs in zip(layer_states(draft_cache), layer_states(reference)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("closed_after", [1, 6, 13])
def test_closing_early_leaves_both_caches_at_the_tokens_yielded(stories, noisy_draft, golden, closed_after):
    model, tokenizer = stories
    ids = golden["generated_ids"]
    cache, draft_cache = model.make_cache(), noisy_draft.make_cache()
    stream = stream_generate(model, tokenizer, [1], max_tokens=100, prompt_cache=cache, draft_model=noisy_draft,
                             draft_cache=draft_cache, num_draft_tokens=5)
    first = [next(stream).token for _ in range(closed_after)]
    stream.close()
    assert first == ids[:closed_after]
    assert cache[0].offset == draft_cache[0].offset == 1 + closed_after
    # the next turn continues exactly (the cache invariant of mlx_tfm.generate)
    second = plain(model, tokenizer, [ids[closed_after]], max_tokens=15, prompt_cache=cache, draft_model=noisy_draft,
                   draft_cache=draft_cache, num_draft_tokens=5)
    assert tokens_of(second) == ids[closed_after + 1 : closed_after + 16]


def test_token_caches_of_a_conversation_stay_in_step(stories, noisy_draft, golden):
    """Through ``TokenCache``: the draft's cache is synced to what the model's holds (a
    saved prompt, earlier turns), then both continue together."""
    model, tokenizer = stories
    ids = golden["generated_ids"]
    target = TokenCache(model)
    feed = target.prepare([1, *ids[:20]])
    model(mx.array([feed[:-1]]), cache=target.layers)  # as if an earlier turn held them
    target.record(feed[:-1])
    draft = TokenCache(noisy_draft)
    sync_draft_cache(draft, target)
    assert draft.tokens == target.tokens and draft.offset == target.offset == 20
    responses = plain(model, tokenizer, feed[-1:], max_tokens=30, prompt_cache=target.layers,
                      draft_model=noisy_draft, draft_cache=draft.layers)
    assert tokens_of(responses) == ids[20:50]
    with pytest.raises(ValueError, match="both must hold the same tokens"):
        plain(model, tokenizer, [ids[50]], max_tokens=3, prompt_cache=target.layers, draft_model=noisy_draft,
              draft_cache=noisy_draft.make_cache())


def test_chat_with_a_draft_model_answers_as_without(stories_hf, tmp_path):
    from fixtures.model_folders import with_chat_template

    from mlx_tfm.chat.conversation import ChatSession, Settings

    model, tokenizer = load(with_chat_template(stories_hf, tmp_path / "chat"))
    plain_session = ChatSession(model, tokenizer, Settings(max_tokens=25))
    draft_session = ChatSession(model, tokenizer, Settings(max_tokens=25), draft_model=model, num_draft_tokens=3)
    lookup_session = ChatSession(model, tokenizer, Settings(max_tokens=25), prompt_lookup_num_tokens=3)
    for message in ("Tell me a story.", "And then?"):
        answers = ["".join(session.answer(message)) for session in (plain_session, draft_session, lookup_session)]
        assert answers[0] == answers[1] == answers[2]
        assert draft_session.draft_cache.tokens == draft_session.cache.tokens
    assert draft_session.last_stats.drafted_tokens > 0


# -- sampling: the model's distribution ---------------------------------------------------


def chi_square_p_value(counts: dict, probabilities: dict) -> float:
    cells = sorted(probabilities)
    observed = np.array([counts.get(c, 0) for c in cells], np.float64)
    expected = np.array([probabilities[c] for c in cells], np.float64)
    expected *= observed.sum() / expected.sum()  # float32 probabilities sum to 1 only nearly
    assert sum(counts.values()) == observed.sum(), "a draw fell outside the support of the model's distribution"
    return scipy_stats.chisquare(observed, expected).pvalue


def test_rejection_rule_gives_the_filtered_target_distribution_at_every_position():
    """``accept_by_rejection`` alone: guesses drawn from q, three positions, each with its
    own p (top-k 4 of 6 at temperature 0.7) and q (full support, far from p)."""
    mx.random.seed(3)
    V, k, draws = 6, 3, 4000
    sampler = make_sampler(temp=0.7, top_k=4)
    logits = mx.random.normal((k + 1, V)) * 2
    target_logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = np.exp(np.array(sampler.log_distribution(target_logprobs)))
    q_logits = mx.random.normal((k, V))
    q = q_logits - mx.logsumexp(q_logits, axis=-1, keepdims=True)
    counts = [dict() for _ in range(k + 1)]
    for _ in range(draws):
        guesses = mx.random.categorical(q).tolist()
        out = accept_by_rejection(guesses, target_logprobs, sampler, q)
        for position, token in enumerate(out):
            counts[position][token] = counts[position].get(token, 0) + 1
    for position in range(k + 1):
        support = {t: p[position, t] for t in range(V) if p[position, t] > 0}
        assert sum(counts[position].values()) > 200
        assert chi_square_p_value(counts[position], support) > 1e-3
    # the test has power: the draft's own distribution at position 0 is far from p
    q0 = np.exp(np.array(q[0], np.float64))
    as_if_drawn_from_q = {t: q0[t] * draws for t in range(V) if p[0, t] > 0}
    assert chi_square_p_value(as_if_drawn_from_q, {t: p[0, t] for t in as_if_drawn_from_q}) < 1e-6


def tiny_model(seed: int) -> Model:
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(tiny_llama_config(vocab_size=8, hidden_size=16, intermediate_size=32)))
    model.update(tree_map(lambda w: w * 3, model.parameters()))  # sharper, less uniform distributions
    mx.eval(model.parameters())
    return model


def exact_sequence_probabilities(model, prompt: list[int], sampler, n: int) -> dict:
    """P(t1..tn) under the model's filtered, tempered distribution, by full forward passes."""
    probabilities = {(): 1.0}
    for _ in range(n):
        longer = {}
        for sequence, probability in probabilities.items():
            logits = model(mx.array([prompt + list(sequence)]))[0, -1:]
            p = np.exp(np.array(sampler.log_distribution(logits - mx.logsumexp(logits, axis=-1, keepdims=True))))[0]
            longer.update({sequence + (t,): probability * p[t] for t in range(len(p)) if p[t] > 0})
        probabilities = longer
    return probabilities


@pytest.mark.parametrize("drafter", ["draft model", "prompt lookup"])
def test_speculative_sampling_follows_the_model_through_the_whole_loop(drafter):
    """Three tokens (two guesses checked at once, then one more step), top-k 3 at
    temperature 1: the joint distribution of the 27 possible sequences, drawn 1000 times,
    against the exact one."""
    target, draft = tiny_model(0), tiny_model(1)
    prompt = [3, 1, 4, 1, 5, 3, 1]  # "3 1" repeats: prompt lookup guesses "4 1"
    sampler = make_sampler(temp=1.0, top_k=3)
    exact = exact_sequence_probabilities(target, prompt, sampler, 3)
    mx.random.seed(5)
    counts, kept = {}, 0
    for _ in range(1000):
        cache = target.make_cache()
        guesser = DraftModel(draft, draft.make_cache(), 8) if drafter == "draft model" else PromptLookup()
        stats_of_run = SpeculationStats()
        tokens = tuple(t for t, _ in speculative_generate_step(mx.array(prompt), target, guesser, num_draft_tokens=2,
                                                               max_tokens=3, sampler=sampler, prompt_cache=cache,
                                                               stats=stats_of_run))
        counts[tokens] = counts.get(tokens, 0) + 1
        kept += stats_of_run.accepted
        assert cache[0].offset == len(prompt) + 3
    assert kept > 100  # guesses were kept often enough for the rule to matter
    assert chi_square_p_value(counts, exact) > 1e-3


# -- bad input ----------------------------------------------------------------------------


def test_a_draft_with_another_vocabulary_is_refused(stories_hf, tmp_path, capsys):
    tokenizer_folder = byte_level_folder(tmp_path)
    other = write_model_folder(tmp_path / "other", tiny_llama_config(vocab_size=300),
                               {name: tokenizer_folder / name for name in ("tokenizer.json", "tokenizer_config.json")})
    code = main(["generate", "--model", str(stories_hf), "--draft-model", str(other), "--max-tokens", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: ") and "\n" not in err
    assert "draft model's tokenizer" in err and "same vocabulary" in err
    # same size, other ids: a tokenizer whose pieces differ
    stories_tokenizer = load_tokenizer(stories_hf)
    with pytest.raises(UserError, match="other token ids"):
        check_draft_tokenizer(stories_tokenizer, _reordered(stories_tokenizer))


def _reordered(tokenizer):
    """A stand-in tokenizer with the same size whose token 10 and 11 are swapped."""
    table = list(tokenizer.token_bytes())
    table[10], table[11] = table[11], table[10]

    class Swapped:
        vocab_size = tokenizer.vocab_size
        eos_token_ids = tokenizer.eos_token_ids
        bos_token_id = tokenizer.bos_token_id

        def token_bytes(self):
            return table

    return Swapped()


@pytest.mark.parametrize("argv, message", [
    (["--num-draft-tokens", "0"], "--num-draft-tokens must be at least 1, got 0"),
    (["--prompt-lookup-num-tokens", "-2"], "--prompt-lookup-num-tokens must be at least 1"),
    (["--prompt-lookup-num-tokens", "3", "--max-kv-size", "64"], "rotating cache cannot"),
])
def test_bad_speculative_flags_are_one_line(stories_hf, capsys, argv, message):
    code = main(["generate", "--model", str(stories_hf), "--max-tokens", "3", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: ") and "\n" not in err and message in err, err


def test_both_draft_and_lookup_is_refused(stories_hf, capsys):
    code = main(["generate", "--model", str(stories_hf), "--draft-model", str(stories_hf),
                 "--prompt-lookup-num-tokens", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == "error: use either a draft model or prompt lookup, not both"


def test_cli_prints_the_acceptance_rate(stories_hf, tmp_path, capsys):
    draft = noisy_copy(stories_hf, tmp_path / "draft", seed=7, scale=0.1)
    assert main(["generate", "--model", str(stories_hf), "--prompt", "Once upon a time", "--max-tokens", "40"]) == 0
    expected = capsys.readouterr().out
    assert main(["generate", "--model", str(stories_hf), "--prompt", "Once upon a time", "--max-tokens", "40",
                 "--draft-model", str(draft), "--num-draft-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == expected
    line = next(line for line in err.splitlines() if line.startswith("Speculative: "))
    accepted, drafted = (int(x) for x in line.split()[1:4:2])
    assert 0 < accepted < drafted and f"({accepted / drafted:.1%})" in line


def test_the_few_rows_of_a_verification_pass_take_the_decoding_kernel(monkeypatch):
    """Checking k guesses multiplies k + 1 rows: with mlx_tfm's kernel in use they take it
    (MLX's x @ W.T is several times slower for so few rows), and the numbers are the
    generic route's."""
    from mlx_tfm.cpu import generic_routes, specialize
    from mlx_tfm.cpu import linear as cpu_linear
    from mlx_tfm.cpu.kernels import kernels

    calls = []
    original = cpu_linear.float32_decode_product
    monkeypatch.setattr(cpu_linear, "float32_decode_product", lambda x, w: calls.append(x.shape) or original(x, w))
    model = specialize(tiny_model(2))
    rows = mx.array([[1, 2, 3, 4]])
    out = model(rows)
    assert bool(calls) == (kernels() is not None) and all(shape[1] == 4 for shape in calls)
    with generic_routes():
        reference = model(rows)
    np.testing.assert_allclose(np.array(out), np.array(reference), rtol=1e-5, atol=1e-5)
    assert not cpu_linear.few_rows(16) and cpu_linear.few_rows(1)
