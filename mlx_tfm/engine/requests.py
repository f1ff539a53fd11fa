"""What a client hands the engine and what it gets back: a ``Request`` (prompt ids, length,
sampling settings, stop strings, logprobs) and one ``Event`` per generated token."""

from __future__ import annotations

from dataclasses import dataclass

from ..generation.sampling import SamplingParams
from .images import ImageInputs

MAX_TOP_LOGPROBS = 20


@dataclass
class Request:
    prompt: list[int]  # token ids (the HTTP layer renders chat templates)
    max_tokens: int
    sampling: SamplingParams = SamplingParams()  # the one type generate and the server use
    stop_strings: tuple[str, ...] = ()  # excluded from the text; finish_reason "stop"
    logprobs: bool = False  # report the chosen token's logprob
    top_logprobs: int = 0  # and this many alternatives (0-20)
    # extra per-row processors: processor(tokens (L,) all tokens so far incl. the prompt,
    # logits (1, V)) -> logits (1, V); called once per generated token, in order
    logits_processors: tuple = ()
    # a vision-language model's images (their tokens are in ``prompt``); the engine runs
    # the tower on its own thread, only when the prompt's image tokens are not cached
    images: ImageInputs | None = None


@dataclass
class Event:
    """One per generated token; the last event of a request has a ``finish_reason``."""

    token: int | None  # None on an error or cancellation event
    text: str  # new text this token completed (stop strings held back / removed)
    logprob: float | None  # when Request.logprobs
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the shared prefix cache
    generation_tokens: int  # tokens generated so far for this request
    error: str | None = None  # one line, when finish_reason == "error"
    internal: bool = False  # the error is an unexpected exception's: its text is for the log, not a client


__all__ = ["Request", "Event", "SamplingParams", "ImageInputs", "MAX_TOP_LOGPROBS"]
