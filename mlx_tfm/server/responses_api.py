"""OpenAI's Responses API beside chat completions, for OpenAI's SDKs, the Agents SDK and
coding agents: ``POST /v1/responses`` (input as a string or a list of items: messages,
function calls and their outputs, reasoning; ``instructions``; function ``tools`` and
``tool_choice``; ``text.format`` for JSON held to a schema; ``max_output_tokens``; typed
server-sent events when streaming; ``reasoning.summary`` writes the thinking as the
reasoning item's summary), ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` (pages of the spec's ResponseItemList,
response_items.py), and ``previous_response_id`` over the responses kept in memory (the
last ``STORED_RESPONSES``).
A request is translated into a chat request and runs through the same machinery
(completions.py); failures are OpenAI's error bodies."""

from __future__ import annotations

import json
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Literal, Union

from pydantic import Field, ValidationError, model_validator
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from ..tokenizer.vision_processor import VisionProcessor
from .completions import answer_deltas, answer_when_done, chat_rows, framed_stream
from .embeddings import decoder_only
from .engine_client import Generation
from .errors import APIError, invalid
from .model_swap import serving_of
from .output import Delta
from .protocol import ChatCompletionRequest, Lenient, parse_body, validation_error
from .response_items import item_resource, items_page
from .workers import in_worker

# How many responses each server keeps for previous_response_id and GET (the oldest go first).
STORED_RESPONSES = 256


# -- requests ----------------------------------------------------------------------------------------


class TextContent(Lenient):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text", "refusal"]
    text: str = ""
    refusal: str | None = None


class ImageContent(Lenient):
    """An image for a vision-language model: a data: URL (or file:// with
    --allow-local-images), as server/images.py reads them."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None  # uploaded files are not kept here: refused by name
    detail: str | None = None


class UnsupportedContent(Lenient):
    """Parts a text model cannot read: refused by name rather than dropped."""

    type: Literal["input_file", "input_audio"]


Content = Annotated[Union[TextContent, ImageContent, UnsupportedContent], Field(discriminator="type")]


def joined(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.refusal or part.text for part in content if isinstance(part, TextContent))


class MessageItem(Lenient):
    type: Literal["message"]
    id: str | None = None  # (every item's id, when the client sends one: its input_items listing keeps it)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Content]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str | list[Content]


class ReasoningItem(Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    content: list[TextContent] | None = None
    summary: list[TextContent] = Field(default_factory=list)

    def text(self) -> str:
        return joined(self.content) if self.content else joined(self.summary)


class UnsupportedItem(Lenient):
    type: Literal["item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
                  "image_generation_call", "code_interpreter_call", "local_shell_call", "mcp_call", "custom_tool_call"]


Item = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem, UnsupportedItem],
                 Field(discriminator="type")]


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a format of type json_schema needs its schema")
        return self


class TextParam(Lenient):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ReasoningParam(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[Item] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextParam = Field(default_factory=TextParam)
    reasoning: ReasoningParam | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _messages_typed(cls, data):
        """EasyInputMessage items ({"role", "content"}) may leave out their type."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [{"type": "message", **item} if isinstance(item, dict) and "type" not in item
                                      and "role" in item else item for item in data["input"]]}
        return data

    def check_fields(self) -> None:
        if isinstance(self.input, list):
            for i, item in enumerate(self.input):
                check_item(item, f"input.{i}")
        if not self.input and self.previous_response_id is None:
            raise invalid("input", "input is empty: give a text or at least one item")


def check_item(item, where: str) -> None:
    if isinstance(item, UnsupportedItem):
        raise invalid(f"{where}.type", f"input items of type {item.type!r} are not supported by this server")
    parts, field = (item.content, "content") if isinstance(item, MessageItem) else \
        (item.output, "output") if isinstance(item, FunctionCallOutputItem) else ([], "")
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        if isinstance(part, UnsupportedContent):
            raise invalid(f"{where}.{field}.{j}.type", f"content of type {part.type!r} is not supported by this server")
        if isinstance(part, ImageContent) and not part.image_url:
            raise invalid(f"{where}.{field}.{j}.image_url", "input_image needs an image_url (a data: URL): file_id "
                          "is not supported by this server")


def check_images(serving, request: ResponsesRequest) -> None:
    """A text-only model refuses the first input_image by name."""
    if isinstance(serving.tokenizer, VisionProcessor) or not isinstance(request.input, list):
        return
    for i, item in enumerate(request.input):
        for j, part in enumerate(item.content if isinstance(item, MessageItem) and isinstance(item.content, list)
                                 else []):
            if isinstance(part, ImageContent):
                raise invalid(f"input.{i}.content.{j}.type", "content of type 'input_image' needs a vision-language "
                              f"model: this one ({serving.model_type or 'text-only'}) reads text only")


def message_content(content: str | list) -> str | list[dict]:
    """A user message's content for the chat request: text, or (with images) OpenAI's
    content parts in order."""
    if isinstance(content, str) or not any(isinstance(part, ImageContent) for part in content):
        return joined(content)
    return [{"type": "image_url", "image_url": {"url": part.image_url}} if isinstance(part, ImageContent) else
            {"type": "text", "text": part.refusal or part.text} for part in content
            if isinstance(part, (ImageContent, TextContent))]


# -- translation into a chat request -----------------------------------------------------------------


class Conversation:
    """Items -> chat messages: function calls join the assistant turn before them, and a
    reasoning item goes with the assistant turn after it."""

    def __init__(self):
        self.messages: list[dict] = []
        self.reasoning = ""
        self.tool_names: dict[str, str] = {}

    def assistant_turn(self) -> dict:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.reasoning:
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self.reasoning:
            last["reasoning_content"], self.reasoning = self.reasoning, ""
        return last

    def add(self, item) -> None:
        if isinstance(item, ReasoningItem):
            self.reasoning += item.text()
        elif isinstance(item, MessageItem) and item.role == "assistant":
            turn = self.assistant_turn()
            turn["content"] = (turn["content"] + "\n" if turn["content"] else "") + joined(item.content)
        elif isinstance(item, MessageItem):
            self.messages.append({"role": item.role, "content": message_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            self.tool_names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            self.assistant_turn().setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            name = self.tool_names.get(item.call_id)
            self.messages.append({"role": "tool", "tool_call_id": item.call_id, "content": joined(item.output),
                                  **({"name": name} if name else {})})


def input_items(request: ResponsesRequest) -> list:
    if isinstance(request.input, str):
        return [MessageItem(type="message", role="user", content=request.input)]
    return list(request.input)


def chat_fields(request: ResponsesRequest) -> dict:
    """The chat request's fields other than its messages."""
    fields: dict[str, Any] = {"model": request.model, "max_tokens": request.max_output_tokens,
                              "temperature": request.temperature, "top_p": request.top_p}
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description,
            **({"parameters": tool.parameters} if tool.parameters is not None else {})}} for tool in request.tools]
    choice = request.tool_choice
    fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}} \
        if isinstance(choice, NamedFunction) else choice
    form = request.text.format
    if form.type == "json_schema":
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": form.name, "schema": form.schema_, "strict": form.strict}}
    elif form.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    effort = request.reasoning.effort if request.reasoning else None
    if effort is not None:  # asking for reasoning opens the template's thinking; the chat API's efforts run low..high
        fields["enable_thinking"] = effort != "none"
        fields["reasoning_effort"] = {"none": "low", "minimal": "low", "xhigh": "high"}.get(effort, effort)
    return fields


def translated(request: ResponsesRequest, history: list) -> ChatCompletionRequest:
    """The chat request of ``history`` (the earlier turns' items) and this request's
    input; the instructions lead it as a system message (never carried from a previous
    response)."""
    conversation = Conversation()
    if request.instructions:
        conversation.messages.append({"role": "system", "content": request.instructions})
    for item in history + input_items(request):
        conversation.add(item)
    fields = {"messages": conversation.messages, **chat_fields(request)}
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None
    chat.check_fields()
    return chat


# -- the stored responses -----------------------------------------------------------------------------


class ResponseStore:
    """The last ``capacity`` responses (their objects, the items of their whole
    conversation, and their own input items as the spec's item resources), least recently
    used first out."""

    def __init__(self, capacity: int = STORED_RESPONSES):
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[dict, list, list]] = OrderedDict()

    def put(self, response: dict, items: list, inputs: list[dict] = ()) -> None:
        self.entries[response["id"]] = (response, items, list(inputs))
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list, list]:
        if response_id not in self.entries:
            raise APIError(404, f"no response with id {response_id!r} is stored on this server", param=param,
                           code="response_not_found")
        self.entries.move_to_end(response_id)
        return self.entries[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.entries[response_id]


_stores: "weakref.WeakKeyDictionary[object, ResponseStore]" = weakref.WeakKeyDictionary()


def store_of(context) -> ResponseStore:
    """The store of this server (one per ServerState, so two servers in a process share nothing)."""
    return _stores.setdefault(context.state, ResponseStore())


# -- the output items ---------------------------------------------------------------------------------


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class TextKind:
    """How one kind of streamed text is written: the item it goes in, the list of that
    item's parts it fills (and the index naming the part), the part, the events' types."""

    item_type: str
    parts: str  # "content" or "summary"
    index_name: str
    part: tuple[tuple[str, object], ...]
    part_added: str
    delta: str
    done: str
    part_done: str
    logprobs: bool = False  # output text's events carry (empty) logprobs

    def new_part(self) -> dict:
        return json_copy(dict(self.part))


TEXT_KINDS = {
    "message": TextKind("message", "content", "content_index",
                        (("type", "output_text"), ("text", ""), ("annotations", []), ("logprobs", [])),
                        "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                        "response.content_part.done", logprobs=True),
    "reasoning": TextKind("reasoning", "content", "content_index", (("type", "reasoning_text"), ("text", "")),
                          "response.content_part.added", "response.reasoning_text.delta",
                          "response.reasoning_text.done", "response.content_part.done"),
    # reasoning.summary asked: the thinking is written as the item's summary (the model's
    # own words: there is no second model here to summarize them)
    "summary": TextKind("reasoning", "summary", "summary_index", (("type", "summary_text"), ("text", "")),
                        "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
                        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"),
}


def new_item(kind: TextKind) -> dict:
    if kind.item_type == "reasoning":
        return {"type": "reasoning", "id": item_id("rs"), "summary": [], "content": [], "status": "in_progress"}
    return {"type": "message", "id": item_id("msg"), "role": "assistant", "content": [], "status": "in_progress"}


class OutputItems:
    """The output items of an answer as it streams, with the typed events that build them:
    a reasoning or message item stays open while its kind of text goes on; each function
    call is an item of its own. ``events`` numbers every event it returns. With
    ``summarize``, reasoning is written as the reasoning item's summary."""

    def __init__(self, summarize: bool = False):
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being written
        self.open_kind: TextKind | None = None
        self.reasoning_kind = TEXT_KINDS["summary" if summarize else "reasoning"]
        self.sequence = 0

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def place(self) -> dict:
        """Where the open item's text goes: its id, its output index, its part's index."""
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, self.open_kind.index_name: 0}

    def open_text(self, kind: TextKind) -> list[dict]:
        events = self.close()
        self.open, self.open_kind = new_item(kind), kind
        self.items.append(self.open)
        part = kind.new_part()
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=json_copy(self.open)))
        events.append(self.event(kind.part_added, **self.place(), part=part))
        self.open[kind.parts].append(dict(part))
        return events

    def text(self, name: str, text: str) -> list[dict]:
        """``text`` of the answer (``name`` "message") or of its reasoning."""
        kind = TEXT_KINDS["message"] if name == "message" else self.reasoning_kind
        events = [] if self.open_kind is kind else self.open_text(kind)
        self.open[kind.parts][0]["text"] += text
        return events + [self.event(kind.delta, **self.place(), delta=text, **({"logprobs": []} if kind.logprobs else {}))]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        kind, place = self.open_kind, self.place()
        item, part = self.open, self.open[self.open_kind.parts][0]
        self.open = self.open_kind = None
        done = self.event(kind.done, **place, text=part["text"], **({"logprobs": []} if kind.logprobs else {}))
        item["status"] = "completed"
        return [done, self.event(kind.part_done, **place, part=json_copy(part)),
                self.event("response.output_item.done", output_index=place["output_index"], item=json_copy(item))]

    def function_call(self, call) -> list[dict]:
        events = self.close()
        item = {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        self.items.append(item)
        index, place = len(self.items) - 1, {"item_id": item["id"], "output_index": len(self.items) - 1}
        events.append(self.event("response.output_item.added", output_index=index, item=json_copy(item)))
        item.update(arguments=call.arguments, status="completed")
        return events + [
            self.event("response.function_call_arguments.delta", **place, delta=call.arguments),
            self.event("response.function_call_arguments.done", **place, name=call.name, arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=json_copy(item))]

    def delta(self, delta: Delta) -> list[dict]:
        events = self.text("reasoning", delta.reasoning) if delta.reasoning else []
        if delta.content:
            events += self.text("message", delta.content)
        for call in delta.tool_calls:
            events += self.function_call(call)
        return events

    def finish(self) -> list[dict]:
        """Close the answer (an empty one is still one message)."""
        events = self.text("message", "") if not self.items else []
        return events + self.close()


def json_copy(value):
    """A deep copy of JSON data (an event must not change as its item goes on)."""
    return json.loads(json.dumps(value))


# -- the response object ------------------------------------------------------------------------------


class Answer:
    """What the response object says beyond its items: its id, times, usage, how it ended."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request = request
        self.model = model
        self.id = item_id("resp")
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.status = "in_progress"
        self.usage: dict | None = None
        self.reasoning_tokens = 0
        self.answering = False  # the answer (text or a call) has begun: later tokens are not reasoning

    def count(self, delta: Delta, event) -> None:
        """Count a token as reasoning while only reasoning has come (its closing tag included)."""
        self.answering = self.answering or bool(delta.content or delta.tool_calls)
        if not self.answering and event.token is not None:
            self.reasoning_tokens += 1

    def end(self, event, answer: Delta) -> None:
        self.reasoning_tokens = self.reasoning_tokens if answer.reasoning else 0
        self.status = "incomplete" if event.finish_reason == "length" else "completed"
        self.completed_at = int(time.time()) if self.status == "completed" else None
        self.usage = {"input_tokens": event.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": event.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": event.generation_tokens,
                      "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": event.prompt_tokens + event.generation_tokens}

    def object(self, output: list[dict]) -> dict:
        request = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "completed_at": self.completed_at,
            "status": self.status, "error": None, "model": self.model, "output": json_copy(output),
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id, "store": request.store,
            "temperature": request.temperature, "top_p": request.top_p, "truncation": "disabled",
            "reasoning": request.reasoning.model_dump() if request.reasoning else None,
            "text": {"format": format_object(request.text.format)}, "tool_choice": tool_choice_object(request),
            "tools": [{"type": "function", "name": tool.name, "description": tool.description,
                       "parameters": tool.parameters, "strict": tool.strict} for tool in request.tools or []],
            # (the spec's usage is never null: a response still in progress has none yet)
            **({"usage": self.usage} if self.usage is not None else {}),
        }


def format_object(form: TextFormat) -> dict:
    if form.type != "json_schema":
        return {"type": form.type}
    return {"type": "json_schema", "name": form.name, "schema": form.schema_, "strict": form.strict,
            **({"description": form.description} if form.description else {})}


def tool_choice_object(request: ResponsesRequest):
    choice = request.tool_choice
    return choice.model_dump() if isinstance(choice, NamedFunction) else (choice or "auto")


def stored_items(output: list[dict]) -> list:
    """The output items as input items, for the next turn of a conversation."""
    return list(ResponsesRequest.model_validate({"input": output}).input)


class Turn:
    """One request's run: its answer so far, its output items, and its storing at the end."""

    def __init__(self, request: ResponsesRequest, model: str, store: ResponseStore, history: list):
        self.request = request
        self.answer = Answer(request, model)
        self.items = OutputItems(summarize=request.reasoning is not None and request.reasoning.summary is not None)
        self.store = store
        self.history = history
        self.inputs = [item_resource(item) for item in input_items(request)]  # their ids fixed for paging

    def response(self) -> dict:
        return self.answer.object(self.items.items)

    def events(self, delta: Delta, event, choice) -> list[dict]:
        """The typed events of one engine event (the closing ones with the last)."""
        self.answer.count(delta, event)
        if not self.request.parallel_tool_calls:  # one call at most: the model's later ones are dropped
            calls = sum(item["type"] == "function_call" for item in self.items.items)
            delta = Delta(delta.content, delta.reasoning, delta.tool_calls[:max(0, 1 - calls)])
        events = self.items.delta(delta)
        if event.finish_reason is not None:
            events += self.items.finish()
            self.answer.end(event, choice.answer)
            if self.request.store:
                conversation = self.history + input_items(self.request) + stored_items(self.items.items)
                self.store.put(self.response(), conversation, self.inputs)
        return events


async def whole_response(serving, generation: Generation, choice, turn: Turn) -> dict:
    async for delta, _, event in answer_deltas(serving, generation, choice):
        turn.events(delta, event, choice)
    return turn.response()


async def response_events(serving, generation: Generation, choice, turn: Turn) -> AsyncIterator[dict]:
    """response.created and .in_progress, the items' events, then response.completed
    (response.incomplete when max_output_tokens cut the answer)."""
    yield turn.items.event("response.created", response=turn.response())
    yield turn.items.event("response.in_progress", response=turn.response())
    async for delta, _, event in answer_deltas(serving, generation, choice):
        for typed in turn.events(delta, event, choice):
            yield typed
    kind = "response.incomplete" if turn.answer.status == "incomplete" else "response.completed"
    yield turn.items.event(kind, response=turn.response())


def typed_event(payload: dict) -> bytes:
    """``event: TYPE`` then ``data: {json}``, as OpenAI streams responses."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode("utf-8")


def error_event(turn: Turn, error: APIError) -> bytes:
    return typed_event(turn.items.event("error", code=error.code, message=error.message, param=error.param))


# -- the endpoints ---------------------------------------------------------------------------------------


def prepared(serving, request: ResponsesRequest, history: list):
    check_images(serving, request)
    return chat_rows(serving, translated(request, history))


async def create_response(http: HTTPRequest, context) -> Response:
    """POST /v1/responses: the answer as a response object, or its typed events."""
    request = parse_body(await context.body(http), ResponsesRequest)
    store = store_of(context)
    history = store.get(request.previous_response_id, "previous_response_id")[1] if request.previous_response_id \
        else []
    async with serving_of(context.state, request.model) as leased:  # held until the rows are in its engine
        serving = decoder_only(leased)
        _, rows, choices = await in_worker(prepared, serving, request, history)
        generation = Generation(serving.engine, rows)
    turn = Turn(request, serving.model_id, store, history)
    if request.stream:
        return framed_stream(response_events(serving, generation, choices[0], turn), generation, typed_event,
                             lambda e: error_event(turn, e), "text/event-stream")
    return await answer_when_done(http, generation, lambda: whole_response(serving, generation, choices[0], turn))


async def get_response(http: HTTPRequest, context) -> Response:
    """GET /v1/responses/{id}: a kept response as it was sent."""
    return JSONResponse(store_of(context).get(http.path_params["response_id"])[0])


async def list_input_items(http: HTTPRequest, context) -> Response:
    """GET /v1/responses/{id}/input_items: a page of a kept response's input items."""
    inputs = store_of(context).get(http.path_params["response_id"])[2]
    return JSONResponse(items_page(inputs, http.query_params))


async def delete_response(http: HTTPRequest, context) -> Response:
    """DELETE /v1/responses/{id}: forget a kept response."""
    response_id = http.path_params["response_id"]
    store_of(context).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


# (path, method, handler, the prefixes it answers under): app.py adds them to its ROUTES.
RESPONSES_ROUTES = (
    ("/responses", "POST", create_response, ("/v1", "")),
    ("/responses/{response_id}", "GET", get_response, ("/v1", "")),
    ("/responses/{response_id}", "DELETE", delete_response, ("/v1", "")),
    ("/responses/{response_id}/input_items", "GET", list_input_items, ("/v1", "")),
)

__all__ = ["RESPONSES_ROUTES", "ResponseStore"]
