"""Choosing the next token: one settings type, and the samplers and logits processors
built from it once.

``SamplingParams`` is every setting of how a token is chosen (the filters, the
temperature, a seed, the penalties, a logit bias). ``generate`` / ``stream_generate``, the
batching engine's rows and the server's requests all carry it; ``make_sampler(...)`` and
``make_logits_processors(...)`` keep mlx-lm's keywords and build from it.

A sampler is one callable ``logprobs (B, V) -> tokens (B,)``: greedy when ``temp == 0``,
else the enabled filters (top-k, top-p, min-p, in that order, on the untempered
log-probabilities, as mlx-lm and llama.cpp do) followed by a categorical draw at
temperature ``temp``. Nothing is decided inside the decoding loop. Without a seed the draw
takes MLX's global random state (``mx.random.seed(n)`` makes it reproducible); with one,
``SeededSampler`` draws from its own key exactly as the engine draws a row with that seed
(``sample_rows``), so one request gives the same tokens from ``generate`` and the server.

The temperature, top-p and min-p values reach the compiled draw as arrays, not as Python
numbers: MLX's CPU backend compiles a C++ kernel for every distinct constant it meets, so
``/set temp 0.75`` or a request with its own temperature reuses the kernels already built. Only which filters are on (and top-k's k, a shape) pick the
compiled function. The filters also take one setting per row, a ``(B, 1)`` array, for
batches whose rows differ; ``SamplingRows`` holds a batch's settings that way.

Logits processors are ``(tokens, logits) -> logits`` applied before the log-softmax: a
logit bias, a repetition penalty, OpenAI's presence and frequency penalties. ``tokens`` is
the context so far (prompt and generated), ``(L,)`` or ``(B, L)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..cpu import pointwise as cpu_pointwise
from ..errors import UserError

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``top_p`` 0 or 1, ``top_k`` 0 and ``min_p`` 0
    disable their filter; ``temp`` 0 is greedy (the filters are then irrelevant)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None  # its own random stream: same seed -> same tokens, alone or batched
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0  # OpenAI semantics, over the generated tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over the generated tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-inf bans it)

    def check(self, vocab_size: int | None = None) -> None:
        """One-line ``UserError`` for settings no sampler can use (token ids of the logit
        bias checked against ``vocab_size`` when given)."""
        if self.temp < 0 or not 0 <= self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise UserError(f"invalid sampling settings: temp={self.temp} (>= 0), top_p={self.top_p} (0..1), "
                            f"top_k={self.top_k} (>= 0), min_p={self.min_p} (0..1)")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise UserError(f"--repetition-penalty must be positive, got {self.repetition_penalty}")
        bias = self.logit_bias or {}
        if vocab_size is not None and not all(0 <= token < vocab_size for token in bias):
            raise UserError(f"logit_bias names token ids outside the model's vocabulary of {vocab_size}")


def log_normalizer(logits: mx.array) -> mx.array:
    """log(sum(exp(logits))) over the vocabulary, kept as size 1 (..., 1): logits minus it
    are log-probabilities. On the CPU, mlx_tfm's kernel (MLX's CPU exp is a scalar loop,
    slow over a whole vocabulary)."""
    if cpu_pointwise.in_use():
        return cpu_pointwise.logsumexp(logits)
    return mx.logsumexp(logits, axis=-1, keepdims=True)


# -- filters: logprobs (B, V) -> logprobs with the excluded tokens at -inf ---------------


def apply_top_k(logprobs: mx.array, top_k: int | mx.array) -> mx.array:
    """Keep exactly ``top_k`` tokens of each row (mlx-lm's rule): the most probable, and
    of tokens tied at the k-th value the lowest ids. ``top_k``: a number, or one per row
    (B, 1) where 0 keeps every token."""
    vocab = logprobs.shape[-1]
    if isinstance(top_k, int):
        if top_k <= 0 or top_k >= vocab:
            return logprobs
        kth = -mx.partition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k - 1 : top_k]  # (B, 1)
    else:
        descending = -mx.sort(-logprobs, axis=-1)  # (B, V)
        kth = mx.take_along_axis(descending, mx.clip(top_k - 1, 0, vocab - 1), axis=-1)  # (B, 1)
    above = logprobs > kth
    tied = logprobs == kth
    room = top_k - above.sum(axis=-1, keepdims=True)  # (B, 1): how many tied tokens still fit
    keep = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))
    if not isinstance(top_k, int):
        keep = keep | (top_k <= 0)
    return mx.where(keep, logprobs, NEG_INF)


def apply_top_p(logprobs: mx.array, top_p: float | mx.array) -> mx.array:
    """Keep the nucleus: the fewest most-probable tokens whose probabilities sum to at
    least ``top_p`` (a token is kept if the tokens above it sum to less than ``top_p``).
    ``top_p``: a number, a scalar array or one per row, (B, 1)."""
    order = mx.argsort(-logprobs, axis=-1)  # (B, V), most probable first
    probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
    mass_above = mx.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_above < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, NEG_INF)


def apply_min_p(logprobs: mx.array, min_p: float | mx.array) -> mx.array:
    """Keep tokens at least ``min_p`` times as probable as the most probable one.
    ``min_p``: a number, a scalar array or one per row, (B, 1)."""
    threshold = logprobs.max(axis=-1, keepdims=True) + mx.log(mx.array(min_p, logprobs.dtype))
    return mx.where(logprobs >= threshold, logprobs, NEG_INF)


# -- samplers ----------------------------------------------------------------------------


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """A callable ``logprobs (B, V) -> tokens (B,)`` (mlx-lm's keywords): the sampler of
    ``SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)``."""
    return sampler_for(SamplingParams(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p))


def sampler_for(settings: SamplingParams) -> Sampler:
    """The sampler of ``settings``: greedy at temperature 0; else a draw from MLX's global
    random state, or from the settings' own seed."""
    settings.check()
    if settings.temp == 0:
        return greedy
    if settings.seed is None:
        return TemperatureSampler(settings.temp, settings.top_p, settings.top_k, settings.min_p)
    return SeededSampler(settings)


class TemperatureSampler:
    """``make_sampler``'s sampler at a temperature above 0: ``sampler(logprobs (B, V))``
    draws tokens (B,). Speculative sampling also needs the distribution a draw follows,
    which ``log_distribution`` gives."""

    def __init__(self, temp: float, top_p: float, top_k: int, min_p: float):
        self.filters = (top_k, 0 < top_p < 1, min_p > 0)  # compiled_draw's key
        self.settings = dict(zip(("inverse_temp", "top_p", "min_p"),
                                 (mx.array(value, mx.float32) for value in (1.0 / temp, top_p, min_p))))
        self.draw = compiled_draw(*self.filters)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self.draw(logprobs, **self.settings)

    def log_distribution(self, logprobs: mx.array) -> mx.array:
        """logprobs (B, V) -> the normalised log-probabilities (B, V) a draw follows (-inf
        where a filter removed the token)."""
        logits = tempered_filtered(logprobs, *self.filters, **self.settings)
        return logits - log_normalizer(logits)


def tempered_filtered(logprobs: mx.array, top_k: int, use_top_p: bool, use_min_p: bool, inverse_temp: mx.array,
                      top_p: mx.array, min_p: mx.array) -> mx.array:
    """The logits a draw is made from: the enabled filters, then the temperature."""
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    if use_top_p:
        logprobs = apply_top_p(logprobs, top_p)
    if use_min_p:
        logprobs = apply_min_p(logprobs, min_p)
    return logprobs * inverse_temp


@functools.lru_cache(maxsize=None)
def compiled_draw(top_k: int, use_top_p: bool, use_min_p: bool):
    """``draw(logprobs, inverse_temp, top_p, min_p) -> tokens``: the enabled filters, then
    a categorical draw, compiled once per process for this choice of filters. The settings
    are array inputs (scalars, or (B, 1) for one per row)."""

    # Compiled with the random state as an input and output, so seeding still governs it.
    @functools.partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
    def draw(logprobs: mx.array, inverse_temp: mx.array, top_p: mx.array, min_p: mx.array) -> mx.array:
        logits = tempered_filtered(logprobs, top_k, use_top_p, use_min_p, inverse_temp, top_p, min_p)
        return mx.random.categorical(logits, axis=-1)

    return draw


# -- one setting per row, one random stream per row --------------------------------------


class SamplingRows:
    """The settings of B rows as arrays (B,), built once per batch composition, so one
    compiled draw serves any mix of values; only which filters any row uses picks it."""

    def __init__(self, rows: list[SamplingParams]):
        self.temps = mx.array([r.temp for r in rows], mx.float32)
        # top_p 0 or 1 disables the filter (as make_sampler): a bound no mass reaches
        self.top_ps = mx.array([r.top_p if 0 < r.top_p < 1 else 2.0 for r in rows], mx.float32)
        self.top_ks = mx.array([r.top_k for r in rows], mx.int32)
        self.min_ps = mx.array([r.min_p for r in rows], mx.float32)
        sampled = [r for r in rows if r.temp > 0]
        self.filters = (any(r.top_k > 0 for r in sampled), any(0 < r.top_p < 1 for r in sampled),
                        any(r.min_p > 0 for r in sampled))
        self.any_sampled = bool(sampled)
        # every row's logit bias as one scatter-add: (row, token id, bias) triples
        triples = [(b, token, bias) for b, r in enumerate(rows) for token, bias in sorted((r.logit_bias or {}).items())]
        self.bias = None
        if triples:
            rows_of, ids, values = zip(*triples)
            self.bias = (mx.array(rows_of, mx.int32), mx.array(ids, mx.int32), mx.array(values, mx.float32))

    def add_logit_bias(self, logits: mx.array) -> mx.array:
        """Logits (B, V) with each row's logit bias added (one operation for the batch, so
        a biased row needs no processor of its own)."""
        if self.bias is None:
            return logits
        rows, ids, values = self.bias
        return logits.at[rows, ids].add(values.astype(logits.dtype))


@functools.lru_cache(maxsize=None)
def keyed_draw(use_top_k: bool, use_top_p: bool, use_min_p: bool):
    """``(logprobs (B, V), temps, top_ps, top_ks, min_ps, keys (B, 2)) -> (tokens (B,),
    next keys (B, 2))``, compiled once for this choice of filters. The draw is Gumbel-max
    with noise from the row's own key, which advances once per token: a seeded row draws
    the same tokens alone or in any batch."""

    def sample(logprobs, temps, top_ps, top_ks, min_ps, keys):
        filtered = logprobs
        if use_top_k:
            filtered = apply_top_k(filtered, top_ks[:, None])
        if use_top_p:
            filtered = apply_top_p(filtered, top_ps[:, None])
        if use_min_p:
            filtered = apply_min_p(filtered, min_ps[:, None])
        pairs = mx.vmap(mx.random.split)(keys)  # (B, 2, 2): the next key, this token's key
        vocab = logprobs.shape[-1]
        noise = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(pairs[:, 1])  # (B, V)
        sampled = filtered / mx.maximum(temps, 1e-6)[:, None] + noise
        scores = mx.where(temps[:, None] > 0, sampled, logprobs)
        return mx.argmax(scores, axis=-1), pairs[:, 0]

    return mx.compile(sample)


def sample_rows(logprobs: mx.array, rows: SamplingRows, keys: mx.array) -> tuple[mx.array, mx.array]:
    """Tokens (B,) for log-probabilities (B, V), each row by its own settings and key,
    and every row's advanced key (B, 2)."""
    if not rows.any_sampled:
        return mx.argmax(logprobs, axis=-1), keys
    draw = keyed_draw(*rows.filters)
    return draw(logprobs.astype(mx.float32), rows.temps, rows.top_ps, rows.top_ks, rows.min_ps, keys)


class SeededSampler:
    """The sampler of settings with a seed: a draw from its own random stream, the
    engine's draw for a row with that seed (``sample_rows``). Several rows at once (a
    speculative check) are drawn in order, each with the next key."""

    def __init__(self, settings: SamplingParams):
        self.rows = SamplingRows([settings])
        self.keys = mx.random.key(settings.seed)[None]  # (1, 2)

    def __call__(self, logprobs: mx.array) -> mx.array:
        tokens = []
        for row in range(logprobs.shape[0]):
            token, self.keys = sample_rows(logprobs[row : row + 1], self.rows, self.keys)
            tokens.append(token)
        return mx.concatenate(tokens)


# -- logits processors -----------------------------------------------------------------


def make_repetition_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Make the last ``context_size`` tokens less likely (CTRL, Keskar et al. 2019): a
    positive logit is divided by ``penalty``, a negative one multiplied by it."""
    if penalty <= 0:
        raise UserError(f"--repetition-penalty must be positive, got {penalty}")

    def repetition_penalty(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        recent = tokens.reshape(-1, tokens.shape[-1])[:, -context_size:]  # (B or 1, <=context)
        recent = mx.broadcast_to(recent, (logits.shape[0], recent.shape[1]))
        selected = mx.take_along_axis(logits, recent, axis=-1)
        penalized = mx.where(selected > 0, selected / penalty, selected * penalty)
        return mx.put_along_axis(logits, recent, penalized, axis=-1)

    return repetition_penalty


def make_presence_frequency_penalty(presence: float, frequency: float, prompt_length: int) -> LogitsProcessor:
    """OpenAI's penalties on the tokens generated so far (the context after the first
    ``prompt_length`` tokens): ``logit -= presence * (count > 0) + frequency * count``."""

    def presence_frequency_penalty(tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens.reshape(-1)[prompt_length:]
        if generated.size == 0:
            return logits
        counts = mx.zeros((logits.shape[-1],), mx.float32).at[generated].add(1.0)  # (V,)
        penalty = presence * (counts > 0) + frequency * counts
        return logits - penalty.astype(logits.dtype)

    return presence_frequency_penalty


def make_logit_bias(logit_bias: dict[int, float]) -> LogitsProcessor:
    """Add a fixed bias to chosen tokens' logits (-inf bans a token)."""
    ids = mx.array(list(logit_bias.keys()), dtype=mx.int32)
    bias = mx.array(list(logit_bias.values()), dtype=mx.float32)

    def apply_logit_bias(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[..., ids].add(bias.astype(logits.dtype))

    return apply_logit_bias


def make_logits_processors(repetition_penalty: float | None = None, repetition_context_size: int = 20,
                           logit_bias: dict[int, float] | None = None) -> list[LogitsProcessor]:
    """The processors these settings ask for (mlx-lm's keywords; an empty list when none)."""
    return processors_for(SamplingParams(repetition_penalty=repetition_penalty,
                                         repetition_context_size=repetition_context_size, logit_bias=logit_bias))


def processors_for(settings: SamplingParams, prompt_length: int = 0) -> list[LogitsProcessor]:
    """Every processor of ``settings``: the logit bias, then ``penalties_for``'s."""
    bias = [make_logit_bias(settings.logit_bias)] if settings.logit_bias else []
    return bias + penalties_for(settings, prompt_length)


def penalties_for(settings: SamplingParams, prompt_length: int) -> list[LogitsProcessor]:
    """The repetition penalty, then the presence and frequency penalties over the tokens
    after the first ``prompt_length`` of the context (the batching engine adds each row's
    logit bias for the whole batch at once, and runs only these per row)."""
    processors = []
    if settings.repetition_penalty is not None and settings.repetition_penalty != 1.0:
        processors.append(make_repetition_penalty(settings.repetition_penalty, settings.repetition_context_size))
    if settings.presence_penalty or settings.frequency_penalty:
        processors.append(make_presence_frequency_penalty(settings.presence_penalty, settings.frequency_penalty,
                                                          prompt_length))
    return processors


__all__ = ["SamplingParams", "make_sampler", "sampler_for", "TemperatureSampler", "SeededSampler", "SamplingRows",
           "sample_rows", "make_logits_processors", "processors_for", "penalties_for",
           "make_presence_frequency_penalty", "apply_top_k", "apply_top_p", "apply_min_p", "greedy"]
