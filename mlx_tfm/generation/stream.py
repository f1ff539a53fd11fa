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

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from ..model.cache import check_quantizable, quantized_layers
from ..model.chunk_bound import chunk_bounded
from ..tokenizer import Tokenizer
from .images import bind_images
from .settings import GenerationSettings
from .step import (
    check_prompt_tokens,
    check_vocabulary,
    context_room,
    encode_prompt,
    generate_step,
)
from .text_to_text import decoder_for_prompt


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


def stream_generate(model, tokenizer: Tokenizer, prompt: str | list[int] | mx.array,
                    settings: GenerationSettings | None = None, *, prompt_cache: list | None = None,
                    draft_cache: list | None = None, images: list | None = None,
                    **options) -> Iterator[GenerationResponse]:
    """Yield a ``GenerationResponse`` per generated token, the last one with a
    ``finish_reason``. Stops on the tokenizer's EOS ids (not shown) and on the stop
    strings (not shown either). See the module docstring for what the ``prompt_cache``
    holds afterwards; a ``draft_model``'s ``draft_cache`` holds the same positions.

    ``settings`` (a ``GenerationSettings``) says how; ``options`` replace its fields by
    keyword, as mlx-lm's are given (``max_tokens=100, sampler=...``) or sampling's
    (``temp=0.7, top_k=40, seed=1``). An encoder-decoder (T5) reads ``prompt`` with its
    encoder once and decodes from its start token. ``images`` (paths, bytes or PIL images):
    for an image-text model, whose ``tokenizer`` is then its ``VisionProcessor``; the
    prompt's placeholders (or its start) take them (generation/images.py)."""
    settings = GenerationSettings.build(settings, **options)
    if images:
        model, prompt = bind_images(model, tokenizer, prompt, images)
        # the whole prompt in one pass: Gemma 3's image tokens attend to each other both ways
        settings = dataclasses.replace(settings, prefill_step_size=max(settings.prefill_step_size, len(prompt)))
    if model.args.kind != "decoder":
        model, prompt = decoder_for_prompt(model, tokenizer, prompt)
    check_vocabulary(model, tokenizer)
    settings.sampling.check(model.args.vocab_size)
    prompt_tokens = encode_prompt(tokenizer, prompt)
    check_prompt_tokens(prompt_tokens, model.args.vocab_size)
    cache = prompt_cache if prompt_cache is not None else chunk_bounded(model, model.make_cache(settings.max_kv_size))
    kv_quantization = settings.kv_quantization()
    if kv_quantization is not None:
        check_quantizable(cache, kv_quantization, model.args.head_dim)
        quantized_layers(cache, kv_quantization)
    room = context_room(model, cache, prompt_tokens.size)
    max_tokens = settings.max_tokens if room is None else min(settings.max_tokens, room)
    pieces = TextPieces(tokenizer, prompt_tokens, list(settings.stop_strings))

    mx.reset_peak_memory()
    start = time.perf_counter()
    tokens, stats = token_stream(model, tokenizer, prompt_tokens, cache, draft_cache, settings, max_tokens)
    yield from responses(tokens, stats, pieces, prompt_tokens.size, max_tokens, start)


def token_stream(model, tokenizer: Tokenizer, prompt_tokens: mx.array, cache: list, draft_cache: list | None,
                 settings: GenerationSettings, max_tokens: int):
    """(the generator of ``(token, logprobs)``, its ``SpeculationStats`` or None)."""
    sampler, processors = settings.sampler_and_processors(prompt_tokens.size)
    step_kwargs = dict(max_tokens=max_tokens, sampler=sampler, logits_processors=processors,
                       prefill_step_size=settings.prefill_step_size)
    if not settings.speculative:
        return generate_step(prompt_tokens, model, prompt_cache=cache, **step_kwargs), None
    from .speculative import speculative_tokens

    return speculative_tokens(prompt_tokens, model, tokenizer, cache, draft_model=settings.draft_model,
                              draft_cache=draft_cache, num_draft_tokens=settings.num_draft_tokens,
                              prompt_lookup_num_tokens=settings.prompt_lookup_num_tokens, **step_kwargs)


def responses(tokens, stats, pieces: TextPieces, n_prompt: int, max_tokens: int,
              start: float) -> Iterator[GenerationResponse]:
    """A ``GenerationResponse`` per token of ``tokens``, with the speeds since ``start``;
    the generator is closed at the first finish."""
    for n, (token, logprobs) in enumerate(tokens, start=1):
        if n == 1:
            generation_start = time.perf_counter()
            prompt_tps = n_prompt / (generation_start - start)
        text, finish_reason = pieces.add(token)
        if finish_reason is None and n == max_tokens:
            tail, finish_reason = pieces.finish()
            text += tail
        elapsed = time.perf_counter() - generation_start
        yield GenerationResponse(
            text=text, token=token, logprobs=logprobs, prompt_tokens=n_prompt, prompt_tps=prompt_tps,
            generation_tokens=n, generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason,
            drafted_tokens=stats.drafted if stats else 0, accepted_tokens=stats.accepted if stats else 0,
        )
        if finish_reason is not None:
            tokens.close()
            return


def generate(model, tokenizer: Tokenizer, prompt: str | list[int], verbose: bool = False,
             settings: GenerationSettings | None = None, **kwargs) -> str:
    """The generated text as one string (``settings`` and ``kwargs`` as for
    ``stream_generate``); with ``verbose``, stream it to stdout and print the statistics."""
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, settings, **kwargs):
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
