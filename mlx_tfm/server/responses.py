"""OpenAI's response objects, built from what the engine reported: chat completions and
their stream chunks, legacy text completions and theirs, usage, and logprobs in both
shapes. Plain dicts, so they serialize as OpenAI's do (``null`` where OpenAI has it). No
``system_fingerprint``: the spec has it optional and a string, and there is no backend
configuration worth naming beyond the model."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .output import Delta, ParsedToolCall


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# -- logprobs -------------------------------------------------------------------------------


class TokenTexts:
    """A token id -> its text and bytes, for logprobs (bytes that are not whole UTF-8
    characters are written as ``\\xNN`` escapes, as OpenAI does)."""

    def __init__(self, token_bytes: list[bytes] | None, decode):
        self._bytes = token_bytes
        self._decode = decode

    def bytes_of(self, token: int) -> bytes:
        if self._bytes is not None and 0 <= token < len(self._bytes):
            return self._bytes[token]
        return self._decode([token]).encode("utf-8")

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", errors="backslashreplace")


def chat_logprob(texts: TokenTexts, token: int, logprob: float, top: list[tuple[int, float]] | None) -> dict:
    """One entry of ``choices[i].logprobs.content``."""

    def entry(token_id: int, value: float) -> dict:
        return {"token": texts.text_of(token_id), "bytes": list(texts.bytes_of(token_id)), "logprob": value}

    return {**entry(token, logprob), "top_logprobs": [entry(t, v) for t, v in (top or [])]}


@dataclass
class LegacyLogprobs:
    """``choices[i].logprobs`` of a text completion: parallel lists."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, texts: TokenTexts, token: int, logprob: float, top: list[tuple[int, float]] | None, offset: int):
        self.tokens.append(texts.text_of(token))
        self.token_logprobs.append(logprob)
        self.top_logprobs.append({texts.text_of(t): v for t, v in (top or [])})
        self.text_offset.append(offset)

    def add_unpredicted(self, texts: TokenTexts, token: int, offset: int) -> None:
        """A prompt's first token: nothing predicts it, so its logprob and alternatives are
        null (as OpenAI's API answers, though its spec types the lists' items as numbers)."""
        self.tokens.append(texts.text_of(token))
        self.token_logprobs.append(None)
        self.top_logprobs.append(None)
        self.text_offset.append(offset)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


# -- chat ----------------------------------------------------------------------------------


def tool_call_dict(call: ParsedToolCall, index: int | None = None) -> dict:
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def chat_message(answer: Delta) -> dict:
    # refusal: the spec requires the field; a local model never refuses through it.
    message = {"role": "assistant", "content": answer.content if answer.content or not answer.tool_calls else None,
               "refusal": None}
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = [tool_call_dict(call) for call in answer.tool_calls]
    return message


def chat_completion(response_id: str, model: str, created: int, choices: list[dict], usage: Usage) -> dict:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage.as_dict()}


def chat_choice(index: int, answer: Delta, finish_reason: str, logprobs: list[dict] | None) -> dict:
    return {"index": index, "message": chat_message(answer),
            "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
            "finish_reason": finish_reason}


def chat_delta(delta: Delta, first_tool_index: int) -> dict:
    """The ``delta`` of a stream chunk; tool calls numbered from ``first_tool_index`` on
    (their index is the call's position in the message, stable across chunks)."""
    body = {}
    if delta.content:
        body["content"] = delta.content
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.tool_calls:
        body["tool_calls"] = [tool_call_dict(call, first_tool_index + i) for i, call in enumerate(delta.tool_calls)]
    return body


def chat_chunk(response_id: str, model: str, created: int, choices: list[dict], with_usage: bool) -> dict:
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if with_usage:
        chunk["usage"] = None  # every chunk but the last, when stream_options.include_usage
    return chunk


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None = None, logprobs: list[dict] | None = None):
    return {"index": index, "delta": delta,
            "logprobs": {"content": logprobs, "refusal": None} if logprobs else None,
            "finish_reason": finish_reason}


def usage_chunk(response_id: str, model: str, created: int, object_name: str, usage: Usage) -> dict:
    return {"id": response_id, "object": object_name, "created": created, "model": model, "choices": [],
            "usage": usage.as_dict()}


# -- legacy completions ----------------------------------------------------------------------


def text_completion(response_id: str, model: str, created: int, choices: list[dict], usage: Usage | None) -> dict:
    body = {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage.as_dict()
    return body


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: LegacyLogprobs | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs.as_dict() if logprobs is not None else None,
            "finish_reason": finish_reason}


def now() -> int:
    return int(time.time())
