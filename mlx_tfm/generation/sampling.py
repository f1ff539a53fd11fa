"""Choosing the next token: samplers and logits processors, each built once.

``make_sampler(...)`` returns one callable ``logprobs (B, V) -> tokens (B,)``: greedy when
``temp == 0``, else the enabled filters (top-k, top-p, min-p, in that order, on the
untempered log-probabilities, as mlx-lm and llama.cpp do) followed by a categorical draw at
temperature ``temp``. Nothing is decided inside the decoding loop.

The temperature, top-p and min-p values reach the compiled draw as arrays, not as Python
numbers: MLX's CPU backend builds a C++ kernel for every distinct constant it meets (about
a second each on Linux), so ``/set temp 0.75`` or a request with its own temperature reuses
the kernels already built. Only which filters are on (and top-k's k, a shape) pick the
compiled function. The filters also take one setting per row, a ``(B, 1)`` array, for
batches whose rows differ.

``make_logits_processors(...)`` returns a list of ``(tokens, logits) -> logits`` applied
before the log-softmax: a repetition penalty and a logit bias. ``tokens`` is the context
so far (prompt and generated), ``(L,)`` or ``(B, L)``.

Sampling draws from MLX's global random state: ``mx.random.seed(n)`` makes it reproducible.
"""

from __future__ import annotations

import functools
from typing import Callable

import mlx.core as mx

from ..cpu import pointwise as cpu_pointwise
from ..errors import UserError

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

NEG_INF = float("-inf")


def log_normalizer(logits: mx.array) -> mx.array:
    """log(sum(exp(logits))) over the vocabulary, kept as size 1 (..., 1): logits minus it
    are log-probabilities. On the CPU, mlx_tfm's kernel (MLX's CPU exp is a scalar loop,
    slow over a whole vocabulary)."""
    if cpu_pointwise.in_use():
        return cpu_pointwise.logsumexp(logits)
    return mx.logsumexp(logits, axis=-1, keepdims=True)


# -- filters: logprobs (B, V) -> logprobs with the excluded tokens at -inf ---------------



def apply_top_k(logprobs: mx.array, k: int) -> mx.array:
    """Keep exactly the ``k`` most probable tokens."""
    if k >= logprobs.shape[-1]:
        return logprobs
    # indices of everything outside the k largest: (B, V - k)
    dropped = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(NEG_INF, logprobs.dtype), axis=-1)


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


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """A callable ``logprobs (B, V) -> tokens (B,)``.

    ``temp`` 0 is greedy (the other settings are then irrelevant). ``top_p`` 0 or 1,
    ``top_k`` 0 and ``min_p`` 0 disable their filter.
    """
    if temp < 0 or not 0 <= top_p <= 1 or top_k < 0 or not 0 <= min_p <= 1:
        raise UserError(
            f"invalid sampling settings: temp={temp} (>= 0), top_p={top_p} (0..1), top_k={top_k} (>= 0), min_p={min_p} (0..1)"
        )
    if temp == 0:
        return greedy
    return TemperatureSampler(temp, top_p, top_k, min_p)


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
    """The processors the settings ask for (an empty list when none)."""
    processors = []
    if logit_bias:
        processors.append(make_logit_bias(logit_bias))
    if repetition_penalty is not None and repetition_penalty != 1.0:
        processors.append(make_repetition_penalty(repetition_penalty, repetition_context_size))
    return processors


__all__ = ["make_sampler", "TemperatureSampler", "make_logits_processors", "make_presence_frequency_penalty", "apply_top_k", "apply_top_p", "apply_min_p", "greedy"]
