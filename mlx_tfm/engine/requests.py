"""What a client hands the engine and what it gets back: a ``Request`` (prompt ids, length,
sampler settings, stop strings, logprobs) and one ``Event`` per generated token."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None  # per-row generator: same seed -> same tokens, alone or batched
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float = 0.0  # OpenAI semantics, over the generated tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over the generated tokens
    logit_bias: dict[int, float] | None = None


@dataclass
class Request:
    prompt: list[int]  # token ids (the HTTP layer renders chat templates)
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple[str, ...] = ()  # excluded from the text; finish_reason "stop"
    logprobs: bool = False  # report the chosen token's logprob
    top_logprobs: int = 0  # and this many alternatives (0-20)
    # extra per-row processors: processor(tokens (L,) all tokens so far incl. the prompt,
    # logits (1, V)) -> logits (1, V); called once per generated token, in order
    logits_processors: tuple = ()


@dataclass
class Event:
    """One per generated token; the last event of a request has a ``finish_reason``."""

    token: int | None  # None on an error or cancellation event
    text: str  # new text this token completed (stop strings held back / removed)
    logprob: float | None  # when Request.logprobs
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the shared prompt cache
    generation_tokens: int  # tokens generated so far for this request
    error: str | None = None  # one line, when finish_reason == "error"
    internal: bool = False  # the error is an unexpected exception's: its text is for the log, not a client
