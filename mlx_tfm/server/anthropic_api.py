"""Anthropic's Messages API beside OpenAI's, for coding agents and Anthropic's clients:
``POST /v1/messages`` (system as a string or text blocks; text, tool_use, tool_result and
thinking blocks; tools with ``input_schema`` and ``tool_choice``; typed server-sent events
when streaming; ``output_config`` for an answer held to a JSON schema; ``stop_reason`` and
``usage``) and ``POST /v1/messages/count_tokens``.
A request is translated into an OpenAI chat request and runs through the same machinery
(completions.py); failures are Anthropic's ``{"type": "error", "error": {...}}``."""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Union

from pydantic import Field, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ..tokenizer.vision_processor import VisionProcessor
from .completions import (
    answer_deltas,
    answer_when_done,
    chat_rows,
    framed_stream,
    prompt_of,
)
from .embeddings import decoder_only
from .engine_client import Generation
from .errors import APIError, internal_error, invalid
from .model_swap import serving_of
from .output import Delta
from .prompts import arguments_object
from .protocol import ChatCompletionRequest, Lenient, parse_body, validation_error
from .workers import in_worker

log = logging.getLogger("mlx_tfm.server")

# Anthropic's error type for each status the server answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


# -- requests ----------------------------------------------------------------------------------------


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ImageSource(Lenient):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None  # base64
    url: str | None = None  # refused: the server fetches nothing (server/images.py)

    def data_url(self) -> str:
        """The image as OpenAI's image_url takes it."""
        return f"data:{self.media_type or 'image/*'};base64,{self.data or ''}" if self.type == "base64" else self.url or ""


class ImageBlock(Lenient):
    type: Literal["image"]
    source: ImageSource


class UnsupportedBlock(Lenient):
    """Blocks a text model cannot read: refused by name rather than dropped."""

    type: Literal["document", "redacted_thinking", "search_result", "server_tool_use"]


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, ImageBlock, UnsupportedBlock],
                  Field(discriminator="type")]


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search...) are not run here


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    """Structured outputs (the answer held to a JSON schema) and the effort to reason with."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    def check_fields(self) -> None:
        for i, message in enumerate(self.messages):
            for j, block in enumerate([] if isinstance(message.content, str) else message.content):
                if isinstance(block, UnsupportedBlock):
                    raise invalid(f"messages.{i}.content.{j}.type",
                                  f"content blocks of type {block.type!r} are not supported by this server")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise invalid("tool_choice.name", "tool_choice of type 'tool' needs the tool's name")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False


# -- translation into an OpenAI chat request -----------------------------------------------------------


def system_messages(system: str | list[TextBlock] | None) -> list[dict]:
    text = system if isinstance(system, str) or system is None else "\n".join(block.text for block in system)
    return [{"role": "system", "content": text}] if text else []


def openai_messages(message: AnthropicMessage, tool_names: dict[str, str]) -> list[dict]:
    """One Anthropic turn as OpenAI messages: an assistant's text, thinking and tool calls
    in one message; a user's tool results as tool messages first, then its text."""
    blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
    text = "\n".join(block.text for block in blocks if isinstance(block, TextBlock))
    if message.role == "assistant":
        calls = [block for block in blocks if isinstance(block, ToolUseBlock)]
        tool_names.update({call.id: call.name for call in calls})
        thinking = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
        rendered: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            rendered["reasoning_content"] = thinking
        if calls:
            rendered["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": json.dumps(call.input, ensure_ascii=False)}} for call in calls]
        return [rendered]
    results = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text(),
                **({"name": tool_names[block.tool_use_id]} if block.tool_use_id in tool_names else {})}
               for block in blocks if isinstance(block, ToolResultBlock)]
    has_text = any(isinstance(block, (TextBlock, ImageBlock)) for block in blocks)
    if any(isinstance(block, ImageBlock) for block in blocks):  # OpenAI's content parts, in order
        text = [{"type": "image_url", "image_url": {"url": block.source.data_url()}} if isinstance(block, ImageBlock)
                else {"type": "text", "text": block.text} for block in blocks if isinstance(block, (TextBlock, ImageBlock))]
    return results + ([{"role": "user", "content": text}] if has_text or not results else [])


def check_images(serving, request: CountTokensRequest) -> None:
    """A text-only model refuses the first image block by name."""
    if isinstance(serving.tokenizer, VisionProcessor):
        return
    for i, message in enumerate(request.messages):
        for j, block in enumerate([] if isinstance(message.content, str) else message.content):
            if isinstance(block, ImageBlock):
                raise invalid(f"messages.{i}.content.{j}.type", "content blocks of type 'image' need a vision-language "
                              f"model: this one ({serving.model_type or 'text-only'}) reads text only")


def openai_tool_choice(choice: ToolChoice | None):
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def output_fields(config: OutputConfig | None) -> dict:
    """output_config as OpenAI's response_format and reasoning_effort (whose top is "high")."""
    if config is None:
        return {}
    fields: dict[str, Any] = {}
    if config.format is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": config.format.schema_}}
    if config.effort is not None:
        fields["reasoning_effort"] = config.effort if config.effort in ("low", "medium") else "high"
    return fields


def translated(request: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI request of an Anthropic one (a value out of range is a 400 naming it)."""
    tool_names: dict[str, str] = {}
    messages = system_messages(request.system)
    for message in request.messages:
        messages += openai_messages(message, tool_names)
    fields: dict[str, Any] = {"model": request.model, "messages": messages,
                              "tool_choice": openai_tool_choice(request.tool_choice)}
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
            for tool in request.tools]
    if request.thinking is not None:
        fields["enable_thinking"] = request.thinking.type != "disabled"
    fields.update(output_fields(request.output_config))
    if isinstance(request, MessagesRequest):
        fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature,
                      top_p=request.top_p, top_k=request.top_k)
    try:
        openai_request = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
    openai_request.check_fields()
    return openai_request


# -- answers -------------------------------------------------------------------------------------------


def tool_use_block(call) -> dict:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name,
            "input": arguments_object(call.arguments)}


def content_blocks(answer: Delta) -> list[dict]:
    blocks = [{"type": "thinking", "thinking": answer.reasoning, "signature": ""}] if answer.reasoning else []
    if answer.content or not answer.tool_calls:
        blocks.append({"type": "text", "text": answer.content})
    return blocks + [tool_use_block(call) for call in answer.tool_calls]


class Stopping:
    """Why the answer ended, in Anthropic's words (a stop string or the model's end)."""

    def __init__(self, serving, stop_strings: tuple[str, ...]):
        self.serving = serving
        self.stop_strings = stop_strings
        self.tokens: list[int] = []

    def add(self, event) -> None:
        if event.token is not None:
            self.tokens.append(event.token)

    def reason(self, event, answer: Delta) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if answer.tool_calls:
            return "tool_use", None
        if event.finish_reason == "length":
            return "max_tokens", None
        if self.stop_strings and event.token not in self.serving.tokenizer.eos_token_ids:
            # The engine cut the stop string from the text: the one the tokens spell first is it.
            text = self.serving.tokenizer.decode(self.tokens)
            found = [(text.find(s), s) for s in self.stop_strings if s in text]
            return "stop_sequence", min(found)[1] if found else self.stop_strings[0]
        return "end_turn", None


def message_object(message_id: str, model: str, content: list[dict], stop: tuple[str | None, str | None],
                   input_tokens: int, output_tokens: int) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


async def whole_message(serving, generation: Generation, choice, stopping: Stopping, model: str) -> dict:
    final = None
    async for _, _, event in answer_deltas(serving, generation, choice):
        stopping.add(event)
        final = event
    return message_object(f"msg_{uuid.uuid4().hex[:24]}", model, content_blocks(choice.answer),
                          stopping.reason(final, choice.answer), final.prompt_tokens, final.generation_tokens)


class BlockStream:
    """The content blocks of a streamed answer: a thinking or text block stays open while
    its kind of text goes on; each tool call is a block of its own."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | None

    def close(self) -> list[dict]:
        closing = [{"type": "content_block_stop", "index": self.index}] if self.open else []
        self.open = None
        return closing

    def text(self, kind: str, text: str) -> list[dict]:
        """Events for ``text`` of ``kind`` ("thinking" or "text")."""
        events = []
        if self.open != kind:
            events = self.close()
            self.index += 1
            self.open = kind
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": self.index, "content_block": start})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def tool_call(self, call) -> list[dict]:
        events = self.close()
        self.index += 1
        block = {**tool_use_block(call), "input": {}}
        return events + [
            {"type": "content_block_start", "index": self.index, "content_block": block},
            {"type": "content_block_delta", "index": self.index,
             "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
            {"type": "content_block_stop", "index": self.index}]

    def delta(self, delta: Delta) -> list[dict]:
        events = self.text("thinking", delta.reasoning) if delta.reasoning else []
        if delta.content:
            events += self.text("text", delta.content)
        for call in delta.tool_calls:
            events += self.tool_call(call)
        return events


async def message_events(serving, generation: Generation, choice, stopping: Stopping, model: str,
                         input_tokens: int) -> AsyncIterator[dict]:
    """message_start, the blocks' start / delta / stop events, message_delta, message_stop."""
    yield {"type": "message_start", "message": message_object(f"msg_{uuid.uuid4().hex[:24]}", model, [],
                                                              (None, None), input_tokens, 0)}
    blocks = BlockStream()
    async for delta, _, event in answer_deltas(serving, generation, choice):
        stopping.add(event)
        for block_event in blocks.delta(delta):
            yield block_event
        if event.finish_reason is not None:
            if blocks.index < 0:  # an empty answer is still one text block
                for block_event in blocks.text("text", ""):
                    yield block_event
            for block_event in blocks.close():
                yield block_event
            reason, sequence = stopping.reason(event, choice.answer)
            yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": {"output_tokens": event.generation_tokens}}
    yield {"type": "message_stop"}


def error_object(error: APIError) -> dict:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def typed_event(payload: dict) -> bytes:
    """``event: TYPE`` then ``data: {json}``, as Anthropic streams."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode("utf-8")


# -- the endpoints ---------------------------------------------------------------------------------------


def anthropic_endpoint(handler):
    """``handler(http, context)`` with its failures in Anthropic's shape; an unexpected one
    is a generic 500 api_error (the traceback goes to the log)."""

    @functools.wraps(handler)
    async def run(http: HTTPRequest, context):
        try:
            return await handler(http, context)
        except APIError as e:
            return JSONResponse(error_object(e), status_code=e.status)
        except Exception:
            log.exception("%s %s failed", http.method, http.url.path)
            error = internal_error()
            return JSONResponse(error_object(error), status_code=error.status)

    return run


@anthropic_endpoint
async def messages(http: HTTPRequest, context) -> Response:
    request = parse_body(await context.body(http), MessagesRequest)
    async with serving_of(context.state, request.model) as leased:  # held until the rows are in its engine
        serving = decoder_only(leased)
        check_images(serving, request)
        openai_request, rows, choices = await in_worker(chat_rows, serving, translated(request))
        generation = Generation(serving.engine, rows)
    stopping = Stopping(serving, openai_request.stop_strings)
    if request.stream:
        events = message_events(serving, generation, choices[0], stopping, request.model, len(rows[0].prompt))
        return framed_stream(events, generation, typed_event, lambda e: typed_event(error_object(e)),
                             "text/event-stream")
    return await answer_when_done(http, generation,
                                  lambda: whole_message(serving, generation, choices[0], stopping, request.model))


def prompt_tokens(serving, request: CountTokensRequest) -> int:
    check_images(serving, request)
    openai_request = translated(request)
    serving.check_model(openai_request.model)
    return len(prompt_of(serving, openai_request)[1])


@anthropic_endpoint
async def count_tokens(http: HTTPRequest, context) -> Response:
    request = parse_body(await context.body(http), CountTokensRequest)
    async with serving_of(context.state, request.model) as leased:  # its tokenizer and template count
        serving = decoder_only(leased)
        return JSONResponse({"input_tokens": await in_worker(prompt_tokens, serving, request)})


# (path, method, handler, the prefixes it answers under): app.py adds them to its ROUTES.
ANTHROPIC_ROUTES = (
    ("/v1/messages", "POST", messages, ("",)),
    ("/v1/messages/count_tokens", "POST", count_tokens, ("",)),
)

__all__ = ["ANTHROPIC_ROUTES"]
