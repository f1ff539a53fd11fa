"""Speculative decoding: cheap guesses of the next tokens, checked by the model in one pass.

Decoding one token reads all of the model's weights for that one token. Here a drafter
guesses the next ``k`` tokens and the model computes its logits after the last accepted
token and after each guess in one forward pass of ``k + 1`` positions, which costs about
as much as one step while the weights dominate; every guess it agrees with is a step saved.

Drafters:

- ``DraftModel``: a smaller model with the same tokenizer runs ``k`` steps ahead in its own
  cache (``--draft-model``, ``--num-draft-tokens``).
- ``PromptLookup``: no model at all (``--prompt-lookup-num-tokens``, transformers' name): the
  longest n-gram (up to ``MAX_NGRAM`` tokens) that ends the text so far is looked up in the
  prompt and the text generated, most recent occurrence first, and the tokens that followed
  it are the guess. Summaries, edits and code copy their input, and then it guesses well.

Acceptance, left to right (``accept_by_matching`` / ``accept_by_rejection``):

- greedy, or a sampler whose distribution is not known: a guess is kept while it equals the
  token the model's own sampler picks at that position, and the first mismatch is replaced by
  that pick. Every token is the model's own choice, so greedy output is plain greedy
  decoding's, token for token.
- ``make_sampler``'s ``TemperatureSampler``: speculative sampling (Leviathan et al. 2023;
  Chen et al. 2023). Where the model's distribution (temperature and filters applied) is
  ``p`` and the drafter's is ``q``, guess ``x`` is kept with probability
  ``min(1, p(x) / q(x))``; the first one rejected is replaced by a draw from
  ``max(p - q, 0)`` renormalised; when all are kept one more token is drawn from ``p``. The
  tokens then follow ``p`` exactly. A prompt-lookup guess has ``q = 1`` at the guessed token.

Both caches are then trimmed back to the accepted tokens. A recurrent layer's
``StateCache`` cannot be trimmed: before a cache reads guesses its recurrent layers are
copied (``checkpoint``), and when a guess is rejected the cache goes back there (its
attention layers trimmed, its states restored) and the accepted tokens are fed again, one
more forward pass of at most ``k + 1`` positions. When the generator stops (done, or
closed by its caller after any token) both hold exactly the prompt and every token yielded,
the cache invariant of ``mlx_tfm.generation``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import numpy as np

from ..errors import UserError
from ..model.cache import RotatingKVCache
from ..model.chunk_bound import chunk_bounded
from ..model.state_cache import StateCache
from ..tokenizer import Tokenizer
from .sampling import (
    LogitsProcessor,
    Sampler,
    TemperatureSampler,
    greedy,
    log_normalizer,
)
from .step import check_finite, prefill
from .token_cache import KEEPS_STATE, TokenCache, common_prefix_length

MAX_NGRAM = 3  # the longest n-gram prompt lookup matches


@dataclass
class SpeculationStats:
    """Counted over one generation: guesses made and guesses the model kept."""

    drafted: int = 0
    accepted: int = 0


# -- checks ------------------------------------------------------------------------------


def check_draft_tokenizer(tokenizer: Tokenizer, draft_tokenizer: Tokenizer) -> None:
    """Token ids mean the same to both models, or a one-line ``UserError``."""
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise UserError(f"the draft model's tokenizer has {draft_tokenizer.vocab_size} tokens and the model's "
                        f"{tokenizer.vocab_size}: speculative decoding needs the same vocabulary")
    same = (draft_tokenizer.token_bytes() == tokenizer.token_bytes()
            and draft_tokenizer.eos_token_ids == tokenizer.eos_token_ids
            and draft_tokenizer.bos_token_id == tokenizer.bos_token_id)
    if not same:
        raise UserError("the draft model's tokenizer gives other token ids than the model's: "
                        "speculative decoding needs the same vocabulary")


def check_rollback(cache: list, what: str) -> None:
    """Rejected guesses are trimmed off; a rotating cache that has wrapped cannot do that."""
    if any(isinstance(layer, RotatingKVCache) for layer in cache):
        raise UserError(f"speculative decoding rolls {what} cache back, which a rotating cache cannot: "
                        "not with --max-kv-size or a model with sliding-window layers")


def check_settings(num_draft_tokens: int, prompt_lookup_num_tokens: int, draft_model) -> None:
    if num_draft_tokens < 1:
        raise UserError(f"--num-draft-tokens must be at least 1, got {num_draft_tokens}")
    if prompt_lookup_num_tokens < 0:
        raise UserError(f"--prompt-lookup-num-tokens must be at least 1 (or 0: off), got {prompt_lookup_num_tokens}")
    if draft_model is not None and prompt_lookup_num_tokens:
        raise UserError("use either a draft model or prompt lookup, not both")


# -- drafters ----------------------------------------------------------------------------


class PromptLookup:
    """Guesses that continue the most recent earlier occurrence of the longest n-gram that
    ends the text so far. ``propose`` -> (tokens (k',), None): ``k' <= k``, maybe 0."""

    def start(self, prompt: mx.array, prefill_step_size: int) -> None:
        pass

    def propose(self, tokens: list[int], k: int, sampler, processors) -> tuple[list[int], None]:
        return lookup(np.asarray(tokens), k), None

    def settle(self, tokens: list[int]) -> None:
        pass


def lookup(tokens: np.ndarray, k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    n-gram (``max_ngram`` down to 1) ending ``tokens``."""
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        # windows (len - n + 1, n); the last one is the n-gram itself, earlier ones candidates
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            start = matches[-1] + n
            return tokens[start : start + k].tolist()
    return []


class DraftModel:
    """A smaller model guessing ``k`` tokens ahead in its own ``cache``, which holds the
    same positions as the model's. ``propose`` -> (tokens (k,), its log-distributions (k, V)
    for speculative sampling, or None)."""

    def __init__(self, model, cache: list, vocab_size: int):
        self.model = model
        self.cache = cache
        self.vocab_size = vocab_size  # the target model's: the guesses' distributions are cut or padded to it
        self.base = cache[0].offset
        self.saved: dict[int, StateCache] = {}  # its recurrent layers before the latest guesses

    def start(self, prompt: mx.array, prefill_step_size: int) -> None:
        prefill(self.model, prompt[:-1], self.cache, prefill_step_size)

    def propose(self, tokens: list[int], k: int, sampler: Sampler, processors) -> tuple[mx.array, mx.array | None]:
        """``tokens``: prompt and accepted tokens; the cache holds a prefix of them."""
        if k == 0:
            return [], None
        self.saved = checkpoint(self.cache)
        fed = self.cache[0].offset - self.base
        step_input = mx.array(tokens[fed:], mx.int32)  # the one or two tokens it has not seen
        context = mx.array(tokens, mx.int32) if processors else None
        guesses, distributions = [], []
        for _ in range(k):
            logits = self.model(step_input[None], cache=self.cache)[:, -1, :]  # (1, V_draft)
            logits = fit_vocabulary(logits, self.vocab_size)
            for processor in processors:
                logits = processor(context, logits)
            logprobs = logits - log_normalizer(logits)
            step_input = sampler(logprobs).astype(mx.int32)  # (1,)
            guesses.append(step_input)
            if isinstance(sampler, TemperatureSampler):
                distributions.append(sampler.log_distribution(logprobs))
            if processors:
                context = mx.concatenate([context, step_input])
        return mx.concatenate(guesses), mx.concatenate(distributions) if distributions else None

    def settle(self, tokens: list[int]) -> None:
        """Hold a prefix of ``tokens`` (the last may be missing): trim what was guessed wrong."""
        settle(self.model, self.cache, self.base, tokens, keep_last=False, saved=self.saved)


def fit_vocabulary(logits: mx.array, vocab_size: int) -> mx.array:
    """Draft logits (1, V_draft) over the target's ``vocab_size`` ids: padding rows cut off,
    or missing ids at -inf (models of one family pad their embeddings differently)."""
    width = logits.shape[-1]
    if width > vocab_size:
        return logits[:, :vocab_size]
    if width < vocab_size:
        return mx.pad(logits, [(0, 0), (0, vocab_size - width)], constant_values=float("-inf"))
    return logits


def checkpoint(cache: list) -> dict[int, StateCache]:
    """Copies of the cache's recurrent layers (layer index -> state), to come back to."""
    return {i: layer.copy() for i, layer in enumerate(cache) if isinstance(layer, KEEPS_STATE)}


def settle(model, cache: list, base: int, tokens: list[int], keep_last: bool,
           saved: dict[int, StateCache] | None = None) -> None:
    """Make ``cache`` hold ``tokens`` (minus the last unless ``keep_last``) after ``base``:
    it holds a prefix of them or guesses beyond them; trim the guesses, feed the rest.
    With recurrent layers, ``saved`` (their ``checkpoint`` before the guesses) is gone
    back to instead of trimming."""
    want = base + len(tokens) - (0 if keep_last else 1)
    held = cache[0].offset
    if held > want and saved:
        held = rewind_to(cache, saved)
    elif held > want:
        for layer in cache:
            layer.trim(held - want)
    if held < want and (keep_last or saved):
        model(mx.array(tokens[held - base : want - base], mx.int32)[None], cache=cache)
        mx.eval([layer.state for layer in cache])


def rewind_to(cache: list, saved: dict[int, StateCache]) -> int:
    """Trim the attention layers back to where ``saved`` was taken and put its states
    back (copies: a later rewind may need them again); returns that position."""
    position = next(iter(saved.values())).offset
    for i, layer in enumerate(cache):
        if i in saved:
            cache[i] = saved[i].copy()
        else:
            layer.trim(layer.offset - position)
    return position


# -- acceptance ----------------------------------------------------------------------------


def accept_by_matching(guesses: list[int], picks: list[int]) -> list[int]:
    """Keep guesses while they equal the model's own picks (k + 1: its sampler on its
    logprobs at each position); then its pick. Returns the accepted guesses and the model's
    token after them."""
    n = 0
    while n < len(guesses) and guesses[n] == picks[n]:
        n += 1
    return guesses[:n] + [picks[n]]


def accept_by_rejection(guesses: list[int], logprobs: mx.array, sampler: TemperatureSampler,
                        draft_log_distributions: mx.array | None) -> list[int]:
    """Speculative sampling: see the module docstring. ``logprobs`` (k + 1, V) are the
    model's, ``draft_log_distributions`` (k, V) the drafter's (None: it guessed with
    certainty, as prompt lookup does)."""
    k = len(guesses)
    p = sampler.log_distribution(logprobs)  # (k + 1, V)
    ids = mx.array(guesses, mx.int32)
    if draft_log_distributions is None:
        q = mx.where(mx.arange(p.shape[-1])[None] == ids[:, None], 0.0, float("-inf"))  # (k, V) one-hot
    else:
        q = draft_log_distributions
    p_guess = mx.take_along_axis(p[:k], ids[:, None], axis=-1)[:, 0]  # (k,)
    q_guess = mx.take_along_axis(q, ids[:, None], axis=-1)[:, 0]
    kept = mx.log(mx.random.uniform(shape=(k,))) < p_guess - q_guess
    residual = mx.maximum(mx.exp(p[:k]) - mx.exp(q), 0.0)  # (k, V)
    # p == q exactly leaves nothing: then a rejection cannot happen and p is as good as any
    nothing_left = residual.sum(axis=-1, keepdims=True) <= 0
    replacement_logits = mx.concatenate([mx.where(nothing_left, p[:k], mx.log(residual)), p[k:]])
    replacements = mx.random.categorical(replacement_logits, axis=-1)  # (k + 1,)
    kept, replacements = kept.tolist(), replacements.tolist()
    n = 0
    while n < k and kept[n]:
        n += 1
    return guesses[:n] + [replacements[n]]


def sync_draft_cache(draft: TokenCache, target: TokenCache) -> None:
    """Make the draft model's ``draft`` hold exactly the tokens the model's ``target``
    holds (a saved prompt cache, a chat's earlier turns): take it back to what they share
    (a recurrent draft: to its longest snapshot there), then feed it the rest."""
    common = draft.rewind(common_prefix_length(draft.tokens, target.tokens))
    rest = target.tokens[common:]
    if rest:
        prefill(draft.model, mx.array(rest, mx.int32), draft.layers)
        draft.record(rest)


# -- the loop ----------------------------------------------------------------------------


def speculative_tokens(prompt: mx.array, model, tokenizer: Tokenizer, cache: list, *, draft_model=None,
                       draft_cache: list | None = None, num_draft_tokens: int = 3, prompt_lookup_num_tokens: int = 0,
                       **step_kwargs) -> tuple[Iterator[tuple[int, mx.array]], SpeculationStats]:
    """``speculative_generate_step`` with a ``DraftModel`` (``draft_model``, whose
    ``draft_cache`` must hold as many positions as ``cache``: the same tokens) or with
    ``PromptLookup``, after the checks; and the stats it counts into."""
    check_settings(num_draft_tokens, prompt_lookup_num_tokens, draft_model)
    if draft_model is None:
        drafter, k = PromptLookup(), prompt_lookup_num_tokens
    else:
        if draft_model.args.vocab_size < tokenizer.vocab_size:
            raise UserError(f"the draft model has {draft_model.args.vocab_size} token embeddings but the tokenizer "
                            f"{tokenizer.vocab_size} tokens: it needs the model's vocabulary")
        draft_cache = draft_cache if draft_cache is not None else chunk_bounded(draft_model, draft_model.make_cache())
        check_rollback(draft_cache, "the draft model's")
        if draft_cache[0].offset != cache[0].offset:
            raise ValueError(f"the draft cache holds {draft_cache[0].offset} positions and the model's cache "
                             f"{cache[0].offset}: both must hold the same tokens")
        drafter, k = DraftModel(draft_model, draft_cache, model.args.vocab_size), num_draft_tokens
    stats = SpeculationStats()
    tokens = speculative_generate_step(prompt, model, drafter, num_draft_tokens=k, prompt_cache=cache, stats=stats,
                                       **step_kwargs)
    return tokens, stats


def verify(model, cache: list, tokens: list[int], guesses, processors: list[LogitsProcessor]) -> mx.array:
    """The model's logprobs (k + 1, V) after the last of ``tokens`` and after each guess,
    in one forward pass: ``tokens[-1]`` and the guesses are fed."""
    fed = mx.concatenate([mx.array(tokens[-1:], mx.int32), mx.array(guesses, mx.int32)])
    logits = model(fed[None], cache=cache)[0]  # (k + 1, V)
    if processors:
        context = mx.concatenate([mx.array(tokens[:-1], mx.int32), fed])
        rows = []
        for i in range(fed.shape[0]):
            row = logits[i : i + 1]
            for processor in processors:
                row = processor(context[: len(tokens) + i], row)
            rows.append(row)
        logits = mx.concatenate(rows)
    return logits - log_normalizer(logits)


def speculative_generate_step(
    prompt: mx.array,
    model,
    drafter: DraftModel | PromptLookup,
    *,
    num_draft_tokens: int,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    prompt_cache: list | None = None,
    prefill_step_size: int = 512,
    stats: SpeculationStats | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield ``(token, logprobs (V,))`` as ``generate_step`` does, ``num_draft_tokens``
    guesses checked per forward pass of the model. ``stats`` counts the guesses."""
    sampler = sampler or greedy
    processors = logits_processors or []
    stats = stats if stats is not None else SpeculationStats()
    cache = prompt_cache if prompt_cache is not None else chunk_bounded(model, model.make_cache())
    check_rollback(cache, "the model's")
    base = cache[0].offset
    for layer_cache in cache:
        layer_cache.reserve(base + prompt.shape[0] + max_tokens + num_draft_tokens)
    prefill(model, prompt[:-1], cache, prefill_step_size)
    drafter.start(prompt, prefill_step_size)

    tokens = prompt.tolist()  # the prompt and every token accepted
    yielded, saved = 0, {}
    try:
        while yielded < max_tokens:
            k = min(num_draft_tokens, max_tokens - yielded - 1)
            guesses, draft_distributions = drafter.propose(tokens, k, sampler, processors)
            saved = checkpoint(cache)
            logprobs = verify(model, cache, tokens, guesses, processors)
            log_norm = mx.logsumexp(logprobs)  # NaN anywhere makes it NaN
            by_rejection = isinstance(sampler, TemperatureSampler) and len(guesses) > 0
            picks = None if by_rejection else sampler(logprobs)
            mx.eval(log_norm, picks, guesses)  # one wait for the whole round
            check_finite(log_norm)
            guesses = guesses if isinstance(guesses, list) else guesses.tolist()
            if by_rejection:
                accepted = accept_by_rejection(guesses, logprobs, sampler, draft_distributions)
            else:
                accepted = accept_by_matching(guesses, picks.tolist())
            stats.drafted += len(guesses)
            stats.accepted += len(accepted) - 1
            tokens += accepted
            settle(model, cache, base, tokens, keep_last=False, saved=saved)
            drafter.settle(tokens)
            for i, token in enumerate(accepted):
                yielded += 1
                yield token, logprobs[i]
    except GeneratorExit:
        finish(model, cache, drafter, base, tokens[: prompt.shape[0] + yielded], saved)
        raise
    finish(model, cache, drafter, base, tokens, saved)


def finish(model, cache: list, drafter, base: int, tokens: list[int], saved: dict[int, StateCache]) -> None:
    """Both caches hold exactly ``tokens``: the prompt and every token yielded."""
    settle(model, cache, base, tokens, keep_last=True, saved=saved)
    if isinstance(drafter, DraftModel):
        settle(drafter.model, drafter.cache, drafter.base, tokens, keep_last=True, saved=drafter.saved)


__all__ = ["speculative_generate_step", "speculative_tokens", "DraftModel", "PromptLookup", "SpeculationStats", "check_draft_tokenizer",
           "lookup", "sync_draft_cache"]
