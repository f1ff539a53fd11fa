"""The decoding loop: prefill a prompt through the cache, then one token at a time
(``generate_step`` yields token ids and their log-probabilities).

The checks that turn a bad input into one line (an empty prompt, a prompt longer than the
context, a tokenizer larger than the model's vocabulary, NaN logits) live here too, so
every caller of the loop gets them.
"""

from __future__ import annotations

from typing import Callable, Iterator

import mlx.core as mx

from ..cpu.switch import prompt_layer_by_layer
from ..errors import UserError
from ..model.cache import (
    RotatingKVCache,
)
from ..model.chunk_bound import chunk_bounded
from ..model.compiled import decoder_for
from ..model.state_cache import StateCache
from ..tokenizer import Tokenizer
from .sampling import LogitsProcessor, Sampler, greedy, log_normalizer

# -- checks ------------------------------------------------------------------------------


def check_vocabulary(model, tokenizer: Tokenizer) -> None:
    """A tokenizer with more ids than the model has embeddings would index past them."""
    if tokenizer.vocab_size > model.args.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.args.vocab_size}: "
            "they do not belong together"
        )


def is_bounded(cache: list) -> bool:
    """Whether every layer forgets old positions (a rotating KV cache) or keeps a
    fixed-size state, so any length fits."""
    return all(isinstance(c, (RotatingKVCache, StateCache)) for c in cache)


def context_room(model, cache: list, n_prompt: int) -> int | None:
    """How many tokens may still be generated after the prompt (None: unbounded)."""
    args = model.args
    if is_bounded(cache) and args.position_embedding != "learned":
        return None
    used = cache[0].offset + n_prompt
    if used >= args.max_position_embeddings:
        raise UserError(
            f"the prompt is {n_prompt} tokens (after {cache[0].offset} cached) but the model's context is "
            f"{args.max_position_embeddings}: shorten it or pass --max-kv-size for a rotating cache"
        )
    return args.max_position_embeddings - used


def check_prompt_tokens(prompt: mx.array, vocab_size: int) -> None:
    if prompt.size == 0:
        raise UserError("the prompt is empty: give some text (or token ids) to continue")
    if prompt.min().item() < 0 or prompt.max().item() >= vocab_size:
        raise UserError(f"the prompt holds token ids outside the model's vocabulary of {vocab_size}")


# -- the decoding loop -------------------------------------------------------------------


def prefill(model, tokens: mx.array, cache: list, step_size: int = 512) -> None:
    """Run ``tokens`` (L,) through the model in chunks of ``step_size``, filling ``cache``.
    The logits are not needed: only the cache is evaluated."""
    # Buffers MLX keeps from earlier work (a previous reply's decoding steps) are of other
    # sizes than a prompt's activations: freed first, they are not held beside them at the
    # pass that needs the most memory.
    mx.clear_cache()
    for start in range(0, tokens.shape[0], step_size):
        with prompt_layer_by_layer():
            model(tokens[None, start : start + step_size], cache=cache)  # (1, chunk)
        mx.eval([c.state for c in cache])
        mx.clear_cache()


def generate_step(
    prompt: mx.array,
    model,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    prompt_cache: list | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int = 512,
) -> Iterator[tuple[int, mx.array]]:
    """Yield ``(token, logprobs (V,))`` for up to ``max_tokens`` new tokens after ``prompt`` (L,).

    The next step is queued (``mx.async_eval``) before the current token is handed out,
    so the model computes while the caller detokenizes and prints. NaN logits raise a
    ``UserError``.
    """
    sampler = sampler or greedy
    cache = prompt_cache if prompt_cache is not None else chunk_bounded(model, model.make_cache(max_kv_size))
    for layer_cache in cache:
        # the prompt and every token yielded (the last one's forward pass is queued too)
        layer_cache.reserve(layer_cache.offset + prompt.shape[0] + max_tokens)
    step = make_step(model, cache, sampler, logits_processors, prompt)

    prefill(model, prompt[:-1], cache, prefill_step_size)
    token, logprobs, log_norm = step(prompt[-1:])
    mx.async_eval(token, logprobs, log_norm)
    for n in range(max_tokens):
        # Queue the forward pass of this token before waiting for it: also for the last
        # one, so that the cache always holds every token yielded.
        next_token, next_logprobs, next_log_norm = step(token)
        mx.async_eval(next_token, next_logprobs, next_log_norm)
        check_finite(log_norm)
        yield token.item(), logprobs
        token, logprobs, log_norm = next_token, next_logprobs, next_log_norm


def check_finite(log_norm: mx.array) -> None:
    """NaN anywhere in the logits makes their log-sum-exp NaN: one number to look at,
    evaluated together with the token."""
    value = log_norm.item()
    if value != value:
        raise UserError("the model produced NaN logits: its weights are broken or overflow in this dtype")


def make_step(model, cache: list, sampler: Sampler, logits_processors: list[LogitsProcessor] | None,
              prompt: mx.array) -> Callable[[mx.array], tuple[mx.array, mx.array, mx.array]]:
    """One decode step ``token (1,) -> (next token (1,), logprobs (V,), log-sum-exp of the
    logits)``, chosen once: without processors no token history is kept at all."""

    def sample(logits: mx.array):
        log_norm = log_normalizer(logits)  # (1, 1)
        logprobs = logits - log_norm
        return sampler(logprobs), logprobs[0], log_norm

    decoder = decoder_for(model)  # each block's cache-free pieces compiled (model/compiled.py)

    def forward(token: mx.array) -> mx.array:
        """token (1,) -> logits (1, V) of the next position."""
        inputs = token[None]  # (1, 1)
        logits = decoder(inputs, cache) if decoder is not None and inputs.shape[1] == 1 else model(inputs, cache=cache)
        return logits[:, -1, :]

    if not logits_processors:

        def step(token):
            return sample(forward(token))

        return step

    history = [prompt[:-1]]  # the context the processors see, without the token being fed

    def step_with_processors(token):
        context = mx.concatenate([*history, token])
        history[:] = [context]
        logits = forward(token)
        for processor in logits_processors:
            logits = processor(context, logits)
        return sample(logits)

    return step_with_processors


# -- text --------------------------------------------------------------------------------


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[int] | mx.array) -> mx.array:
    """Token ids (L,) of a prompt; text gets BOS unless it already starts with it (as a
    rendered chat template does)."""
    if isinstance(prompt, str):
        bos = tokenizer.special_tokens.get("bos_token")
        add_special = not (bos and prompt.startswith(bos))
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(prompt, dtype=mx.int32).reshape(-1)
