"""Text generation, in layers: prefill -> decode step -> ``generate_step`` (token ids) ->
``stream_generate`` (text pieces and statistics) -> ``generate`` (one string).

The cache invariant, which the chat REPL relies on: ``generate_step`` and
``stream_generate`` process only the tokens they are given, on top of whatever a passed
``prompt_cache`` already holds, and when they stop (finished, or closed early by the
caller) the cache holds the prompt and *every token yielded so far*, the last one
included (also an EOS token or the token that completed a stop string). So
``cache[0].offset == offset_before + len(prompt_tokens) + tokens_yielded``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx

from .cache import DEFAULT_QUANTIZED_KV_START, KVQuantization, RotatingKVCache, check_quantizable, quantized_layers
from .cpu.switch import prompt_layer_by_layer
from .errors import UserError
from .sample import LogitsProcessor, Sampler, greedy, log_normalizer
from .text_to_text import decoder_for_prompt
from .tokenizer import Tokenizer


@dataclass
class GenerationResponse:
    """One step of ``stream_generate``.

    ``text`` is the new text this token completed (often "" while a character or a
    possible stop string is held back); ``token`` the id sampled; ``logprobs`` the
    log-probabilities over the vocabulary it was sampled from, shape (V,);
    ``finish_reason`` is "stop" (EOS or a stop string), "length" (max_tokens or the
    model's context) or None while generating. Speeds are tokens per second;
    ``peak_memory`` is in GB. With speculative decoding, ``drafted_tokens`` guesses were
    made so far and ``accepted_tokens`` of them kept.
    """

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0


# -- checks ------------------------------------------------------------------------------


def check_vocabulary(model, tokenizer: Tokenizer) -> None:
    """A tokenizer with more ids than the model has embeddings would index past them."""
    if tokenizer.vocab_size > model.args.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.args.vocab_size}: "
            "they do not belong together"
        )


def is_bounded(cache: list) -> bool:
    """Whether every layer forgets old positions, so any length fits."""
    return all(isinstance(c, RotatingKVCache) for c in cache)


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
    cache = prompt_cache if prompt_cache is not None else model.make_cache(max_kv_size)
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

    if not logits_processors:

        def step(token):
            return sample(model(token[None], cache=cache)[:, -1, :])  # logits (1, V)

        return step

    history = [prompt[:-1]]  # the context the processors see, without the token being fed

    def step_with_processors(token):
        context = mx.concatenate([*history, token])
        history[:] = [context]
        logits = model(token[None], cache=cache)[:, -1, :]
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


class StopStringFilter:
    """Holds back text that could be the start of a stop string; reports a stop string
    as soon as it is complete, returning the text before it."""

    def __init__(self, stop_strings: list[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stop_strings) if i >= 0]
        if found:
            out, self.pending = self.pending[: min(found)], ""
            return out, True
        hold = max((k for s in self.stop_strings for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextPieces:
    """Token ids -> the text pieces to show: streams through the detokenizer, holds back
    what could start a stop string, and says when generation should stop."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: mx.array, stop_strings: list[str] | None):
        # SentencePiece drops the space before the first word only at the start of a text.
        at_start = tokenizer.decode(prompt_tokens[-1:].tolist()) == ""
        self.detokenizer = tokenizer.make_detokenizer(at_start_of_text=at_start)
        self.stops = StopStringFilter(stop_strings or [])
        self.eos = tokenizer.eos_token_ids

    def add(self, token: int) -> tuple[str, str | None]:
        """(text to show, "stop" or None)."""
        if token in self.eos:
            return self.stops.flush() + self._finalize(), "stop"
        self.detokenizer.add_token(token)
        text, stopped = self.stops.push(self.detokenizer.last_segment)
        return text, "stop" if stopped else None

    def finish(self) -> tuple[str, str]:
        """At the token limit: the rest of the text, and "length" (or "stop" if the held
        back text completes a stop string after all)."""
        text, stopped = self.stops.push(self._finalize())
        return (text, "stop") if stopped else (text + self.stops.flush(), "length")

    def _finalize(self) -> str:
        self.detokenizer.finalize()
        return self.detokenizer.last_segment


def stream_generate(
    model,
    tokenizer: Tokenizer,
    prompt: str | list[int] | mx.array,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    prompt_cache: list | None = None,
    max_kv_size: int | None = None,
    prefill_step_size: int = 512,
    stop_strings: list[str] | None = None,
    draft_model=None,
    num_draft_tokens: int = 3,
    prompt_lookup_num_tokens: int = 0,
    draft_cache: list | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
) -> Iterator[GenerationResponse]:
    """Yield a ``GenerationResponse`` per generated token, the last one with a
    ``finish_reason``. Stops on the tokenizer's EOS ids (not shown) and on
    ``stop_strings`` (not shown either). See the module docstring for what the
    ``prompt_cache`` holds afterwards.

    Speculative decoding (``mlx_tfm.speculative``): a ``draft_model`` guessing
    ``num_draft_tokens`` ahead (its ``draft_cache`` holding the same positions as
    ``prompt_cache``), or ``prompt_lookup_num_tokens`` guessed from the prompt. ``kv_bits``
    (4 or 8) quantizes the cache's ``KVCache`` layers once they hold more than
    ``quantized_kv_start`` positions, in groups of ``kv_group_size``. An encoder-decoder
    (T5) reads ``prompt`` with its encoder once and decodes from its start token."""
    if model.args.kind != "decoder":
        model, prompt = decoder_for_prompt(model, tokenizer, prompt)
    check_vocabulary(model, tokenizer)
    prompt_tokens = encode_prompt(tokenizer, prompt)
    check_prompt_tokens(prompt_tokens, model.args.vocab_size)
    cache = prompt_cache if prompt_cache is not None else model.make_cache(max_kv_size)
    if kv_bits is not None:
        kv_quantization = KVQuantization(kv_bits, kv_group_size, quantized_kv_start)
        check_quantizable(cache, kv_quantization, model.args.head_dim)
        quantized_layers(cache, kv_quantization)
    room = context_room(model, cache, prompt_tokens.size)
    max_tokens = max_tokens if room is None else min(max_tokens, room)
    pieces = TextPieces(tokenizer, prompt_tokens, stop_strings)

    mx.reset_peak_memory()
    start = time.perf_counter()
    step_kwargs = dict(max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
                       prefill_step_size=prefill_step_size)
    if draft_model is not None or prompt_lookup_num_tokens:
        from .speculative import speculative_tokens

        tokens, stats = speculative_tokens(
            prompt_tokens, model, tokenizer, cache, draft_model=draft_model, draft_cache=draft_cache,
            num_draft_tokens=num_draft_tokens, prompt_lookup_num_tokens=prompt_lookup_num_tokens, **step_kwargs,
        )
    else:
        tokens, stats = generate_step(prompt_tokens, model, prompt_cache=cache, **step_kwargs), None
    for n, (token, logprobs) in enumerate(tokens, start=1):
        if n == 1:
            generation_start = time.perf_counter()
            prompt_tps = prompt_tokens.size / (generation_start - start)
        text, finish_reason = pieces.add(token)
        if finish_reason is None and n == max_tokens:
            tail, finish_reason = pieces.finish()
            text += tail
        elapsed = time.perf_counter() - generation_start
        yield GenerationResponse(
            text=text, token=token, logprobs=logprobs, prompt_tokens=prompt_tokens.size, prompt_tps=prompt_tps,
            generation_tokens=n, generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason,
            drafted_tokens=stats.drafted if stats else 0, accepted_tokens=stats.accepted if stats else 0,
        )
        if finish_reason is not None:
            tokens.close()
            return


def generate(model, tokenizer: Tokenizer, prompt: str | list[int], verbose: bool = False, **kwargs) -> str:
    """The generated text as one string (``kwargs`` as for ``stream_generate``); with
    ``verbose``, stream it to stdout and print the statistics."""
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print(format_stats(response))
    return text


def format_stats(response: GenerationResponse) -> str:
    lines = [
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec",
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec",
    ]
    if response.drafted_tokens:
        rate = response.accepted_tokens / response.drafted_tokens
        lines.append(f"Speculative: {response.accepted_tokens} of {response.drafted_tokens} drafted tokens "
                     f"accepted ({rate:.1%})")
    lines.append(f"Peak memory: {response.peak_memory:.3f} GB")
    return "\n".join(lines)


__all__ = [
    "GenerationResponse",
    "generate",
    "stream_generate",
    "generate_step",
    "prefill",
]
