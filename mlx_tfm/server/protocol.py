"""The request bodies, as pydantic v2 models: what OpenAI's API accepts for chat and
legacy completions, plus the sampling extensions local servers share (top_k, min_p,
repetition_penalty, chat_template_kwargs). Unknown fields are ignored, as OpenAI's clients
send some (user, store, metadata) that change nothing here. A value out of range is a 400
that names the field (``parse_body``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..errors import UserError
from ..jsonfile import parse_json
from .errors import APIError, invalid
from .settings import MAX_N, MAX_PROMPTS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's spec marks most request fields nullable: ``null`` means the field's
        default (``n: null`` is one choice, ``stream: null`` no stream)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields

        def has_other_default(key: str) -> bool:  # a required field's null stays, for the field to judge
            return key in fields and not fields[key].is_required() and fields[key].default is not None

        return {key: value for key, value in data.items() if value is not None or not has_other_default(key)}


# -- chat messages ------------------------------------------------------------------------


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ImageURL(Lenient):
    url: str  # a data: URL (base64), or file:// behind --allow-local-images
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the family's preprocessing decides


class ImagePart(Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class AudioPart(Lenient):
    """OpenAI's audio input: accepted by the schema so that it is refused by name (no model
    here reads audio; Gemma 4's audio tower is not loaded), not as a wrong text part."""

    type: Literal["input_audio"]
    input_audio: dict | None = None


ContentPart = TextPart | ImagePart | AudioPart


class FunctionCall(Lenient):
    name: str
    arguments: str = "{}"  # a JSON text, as OpenAI sends it


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        audio = [i for i, part in enumerate(self.content or ()) if isinstance(part, AudioPart)]
        if isinstance(self.content, list) and audio:
            raise ValueError(f"content part {audio[0]} is input_audio: audio input is not supported by this server "
                             "(no model here reads audio; Gemma 4's audio tower is not loaded)")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


# -- tools and structured output ---------------------------------------------------------------


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(Lenient):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return self


class StreamOptions(Lenient):
    include_usage: bool = False


# -- the shared sampling fields -------------------------------------------------------------------


class SamplingFields(Lenient):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # 64 bits, signed or not
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    repetition_context_size: int = Field(default=20, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)  # the spec's bound; the engine queues rows past its batch
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("a stop string is empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are in -100..100, got {bias} for token {key}")
        return value

    def check_fields(self) -> None:
        """Checks across fields (none here; the subclasses add theirs)."""

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # vLLM's and mlx-lm's shortcut for chat_template_kwargs' enable_thinking
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # OpenAI's; gpt-oss's template reads it

    def check_fields(self) -> None:
        """Checks across fields, each a 400 naming its field."""
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
        names = [tool.function.name for tool in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise invalid("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice == "required" and not self.tools:
            raise invalid("tool_choice", "tool_choice 'required' needs tools")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(SamplingFields):
    # required, as the spec has it; null: its default, a document's start (the BOS token, where the tokenizer adds one)
    prompt: Union[str, list[str], TokenIds, list[TokenIds], None]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt (with echo), generate nothing
    logprobs: int | None = Field(default=None, ge=0, le=5)  # legacy: how many alternatives
    echo: bool = False
    suffix: str | None = None  # fill-in-the-middle: the text after the insertion (server/fim.py)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, (list, str)) and len(p) == 0 for p in value)):
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], (list, str)) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request holds: texts or token id lists."""
        if self.prompt is None:
            return [""]
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


# -- parsing a body -------------------------------------------------------------------------------


def parse_body(raw: bytes, model_type: type[BaseModel]):
    """The request model of a JSON body, or a 400 naming the field that is wrong."""
    try:
        data = parse_json(raw.decode("utf-8"), "the body")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except UserError as e:
        raise APIError(400, str(e), code="invalid_json") from None
    where = lone_surrogate_at(data)
    if where is not None:  # JSON allows "\ud800"; no tokenizer can encode it
        raise invalid(where or "body", f"{where or 'the body'}: a lone UTF-16 surrogate (\\ud800-\\udfff) is not text",
                      code="invalid_text")
    try:
        request = model_type.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    request.check_fields()
    return request


def lone_surrogate_at(value, path: str = "") -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, or None.
    Walks with a stack: the body may be nested as deep as the JSON reader allows."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not _is_utf8(item):
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                if not _is_utf8(key):
                    return where
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{where}.{i}" if where else str(i)) for i, child in enumerate(item))
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validation_error(error: ValidationError) -> APIError:
    """The most telling problem pydantic found, as a 400 that names the field
    ("messages.0.role"): of the branches of a union, the one that got furthest in."""
    first = max(error.errors(include_url=False), key=_specificity)
    location = [str(part) for part in first["loc"] if not _is_union_branch(part)]
    param = ".".join(location) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "this field is required"
    elif first["type"] == "literal_error" and "input" in first:
        message = f"{message} (got {json.dumps(first['input'])[:80]})"
    return invalid(param or "body", f"{param}: {message}" if param else message)


def _specificity(error: dict) -> tuple[int, int]:
    """Errors deeper in the body first; a wrong value before a wrong type."""
    return len([p for p in error["loc"] if not _is_union_branch(p)]), not error["type"].endswith("_type")


def _is_union_branch(part) -> bool:
    """pydantic names the union member it tried ("str", "list[TextPart]", "function-after[...]")."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict",
                                                               "NamedToolChoice", "TextPart", "ImagePart",
                                                               "AudioPart"})
