"""Ollama's API beside OpenAI's, for the apps that speak only Ollama's: ``/api/chat`` and
``/api/generate`` (NDJSON streams by default, ``format`` as "json" or a JSON schema,
``options`` for the samplers, ``think``, tools, logprobs), ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``, ``/api/embed`` and ``/api/embeddings`` (on an encoder's server), and
``/api/pull`` (nothing is downloaded: the served model is already there, any other is an
error). A request is translated into an OpenAI chat request and runs through the same
machinery (completions.py); failures are Ollama's ``{"error": "..."}`` with the status."""

from __future__ import annotations

import functools
import json
import logging
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Literal

from pydantic import Field, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from .completions import answer_deltas, answer_when_done, chat_rows, framed_stream
from .embeddings import EncoderServing, decoder_only, embeddings_response, encoder_only
from .engine_client import Generation
from .errors import APIError, internal_error, invalid
from .model_swap import serving_of
from .output import Delta
from .prompts import arguments_object
from .protocol import ChatCompletionRequest, Lenient, Tool, parse_body, validation_error
from .workers import in_worker

log = logging.getLogger("mlx_tfm.server")

# The Ollama release whose API this mirrors (clients such as Open WebUI gate features on it).
OLLAMA_API_VERSION = "0.12.0"


# -- requests -----------------------------------------------------------------------------------


class OllamaFunctionCall(Lenient):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not a JSON text as OpenAI's


class OllamaToolCall(Lenient):
    function: OllamaFunctionCall


class OllamaMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # tool turns: the tool that answered


class Options(Lenient):
    """The sampler options; the runtime ones (num_ctx, num_gpu, num_thread...) are ignored,
    as the server was started with its own."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None  # -1 (endless) and -2 (fill the context): the server's --max-tokens
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class OllamaRequest(Lenient):
    model: str = ""
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: str | float | None = None  # accepted: the served model stays loaded
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_fields(self) -> None:
        if isinstance(self.format, str) and self.format not in ("", "json"):
            raise invalid("format", f"format must be \"json\" or a JSON schema object, got {self.format!r}")


class OllamaChatRequest(OllamaRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Tool] | None = None


class OllamaGenerateRequest(OllamaRequest):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None

    def check_fields(self) -> None:
        super().check_fields()
        for name in ("suffix", "template", "context"):
            if getattr(self, name):
                raise invalid(name, f"{name} is not supported by this server")


class EmbedRequest(Lenient):
    model: str = ""
    input: str | list[str] = Field(default="")
    prompt: str | None = None  # /api/embeddings' one text
    truncate: bool = True  # inputs are always cut to the model's length, as sentence-transformers cuts them
    dimensions: int | None = None
    keep_alive: str | float | None = None

    def check_fields(self) -> None:
        """Nothing across fields."""


class ModelRequest(Lenient):
    """/api/show's body: the model's name."""

    model: str = ""
    name: str = ""  # the older spelling of model

    def check_fields(self) -> None:
        """Nothing across fields."""


class PullRequest(ModelRequest):
    stream: bool = True


# -- translation into an OpenAI chat request ---------------------------------------------------------


def served_name(name: str) -> str:
    """Ollama's clients name models with a tag; ':latest' is the one tag this server has."""
    return name.removesuffix(":latest")


def image_parts(images: list[str], text: str) -> list[dict]:
    """Ollama's base64 images and the text as OpenAI content parts: the images first."""
    return [*({"type": "image_url", "image_url": {"url": f"data:image/*;base64,{data}"}} for data in images),
            {"type": "text", "text": text}]


def openai_message(message: OllamaMessage, index: int) -> dict:
    content = image_parts(message.images, message.content) if message.images else message.content
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.thinking:
        rendered["reasoning_content"] = message.thinking
    if message.tool_name:
        rendered["name"] = message.tool_name
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": f"call_{index}_{i}", "type": "function", "function": {
            "name": call.function.name, "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}}
            for i, call in enumerate(message.tool_calls)]
    return rendered


def sampling_fields(request: OllamaRequest) -> dict:
    """Ollama's options and switches as OpenAI's request fields (values the server's
    defaults stand for are left out)."""
    options = request.options or Options()
    fields = {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
              "min_p": options.min_p, "seed": options.seed, "stop": options.stop,
              "repetition_penalty": options.repeat_penalty,
              "presence_penalty": options.presence_penalty, "frequency_penalty": options.frequency_penalty,
              "max_tokens": options.num_predict if options.num_predict is None or options.num_predict >= 0 else None}
    if options.repeat_last_n is not None and options.repeat_last_n > 0:
        fields["repetition_context_size"] = options.repeat_last_n
    if isinstance(request.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "response",
                                                                            "schema": request.format}}
    elif request.format == "json":
        fields["response_format"] = {"type": "json_object"}
    if request.logprobs:  # the entries are OpenAI's chat ones: token, logprob, bytes, top_logprobs
        fields.update(logprobs=True, top_logprobs=request.top_logprobs)
    if request.think is not None:
        fields["enable_thinking"] = request.think is not False
        fields["reasoning_effort"] = request.think if isinstance(request.think, str) else None
    return {name: value for name, value in fields.items() if value is not None}


def chat_request(fields: dict) -> ChatCompletionRequest:
    """The OpenAI request the translated fields make (a value out of its range is a 400
    that names it, as OpenAI's endpoint names it)."""
    try:
        request = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from None
    request.check_fields()
    return request


def translated_chat(request: OllamaChatRequest) -> ChatCompletionRequest:
    fields = {"model": served_name(request.model), **sampling_fields(request),
              "messages": [openai_message(m, i) for i, m in enumerate(request.messages)]}
    if request.tools:
        fields["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
    return chat_request(fields)


def translated_generate(request: OllamaGenerateRequest) -> ChatCompletionRequest:
    system = [{"role": "system", "content": request.system}] if request.system else []
    content = image_parts(request.images, request.prompt) if request.images else request.prompt
    return chat_request({"model": served_name(request.model), **sampling_fields(request),
                         "messages": [*system, {"role": "user", "content": content}]})


# -- answers ------------------------------------------------------------------------------------------


def timestamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_tool_calls(delta: Delta) -> list[dict]:
    return [{"function": {"name": call.name, "arguments": arguments_object(call.arguments)}}
            for call in delta.tool_calls]


def chat_piece(delta: Delta) -> dict:
    """A piece of the answer as Ollama's ``message`` (or, reshaped, ``response``)."""
    message = {"role": "assistant", "content": delta.content}
    if delta.reasoning:
        message["thinking"] = delta.reasoning
    if delta.tool_calls:
        message["tool_calls"] = ollama_tool_calls(delta)
    return message


def generate_piece(delta: Delta) -> dict:
    return {"response": delta.content, **({"thinking": delta.reasoning} if delta.reasoning else {})}


class Timing:
    """Ollama's durations (nanoseconds): the prompt until the first token, then the rest."""

    def __init__(self):
        self.start = self.first_token = time.perf_counter_ns()

    def token(self, generation_tokens: int) -> None:
        if generation_tokens == 1:
            self.first_token = time.perf_counter_ns()

    def final(self, event) -> dict:
        end = time.perf_counter_ns()
        return {"done": True, "done_reason": "length" if event.finish_reason == "length" else "stop",
                "total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_count": event.prompt_tokens, "prompt_eval_duration": self.first_token - self.start,
                "eval_count": event.generation_tokens, "eval_duration": end - self.first_token}


async def ollama_stream(serving, generation: Generation, choice, model: str, piece) -> AsyncIterator[dict]:
    """Ollama's stream: a line per piece of the answer, then the final one with the counts."""
    timing = Timing()
    async for delta, logprobs, event in answer_deltas(serving, generation, choice):
        timing.token(event.generation_tokens)
        if delta or logprobs:
            yield {"model": model, "created_at": timestamp(), **piece(delta), "done": False,
                   **({"logprobs": logprobs} if logprobs else {})}
        if event.finish_reason is not None:
            yield {"model": model, "created_at": timestamp(), **piece(Delta()), **timing.final(event)}


async def ollama_answer(serving, generation: Generation, choice, model: str, piece) -> dict:
    timing, final = Timing(), None
    async for _, _, event in answer_deltas(serving, generation, choice):
        timing.token(event.generation_tokens)
        final = event
    logprobs = {} if choice.logprobs is None else {"logprobs": choice.logprobs}
    return {"model": model, "created_at": timestamp(), **piece(choice.answer), **timing.final(final), **logprobs}


def ndjson(chunk: dict) -> bytes:
    return json.dumps(chunk, ensure_ascii=False).encode("utf-8") + b"\n"


def error_line(error: APIError) -> bytes:
    return ndjson({"error": error.message})


async def answer(http: HTTPRequest, serving, request: OllamaRequest, translated: ChatCompletionRequest,
                 raw_prompt: str | None, piece) -> Response:
    """Run the translated request on the engine; stream it or answer when done."""
    _, rows, choices = await in_worker(chat_rows, serving, translated, raw_prompt)
    generation = Generation(serving.engine, rows)
    model = request.model or serving.model_id
    if request.stream:
        return framed_stream(ollama_stream(serving, generation, choices[0], model, piece), generation, ndjson,
                             error_line, "application/x-ndjson")
    return await answer_when_done(http, generation,
                                  lambda: ollama_answer(serving, generation, choices[0], model, piece))


def loaded(request: OllamaRequest, serving, piece) -> JSONResponse:
    """An empty prompt loads the model (Ollama's way to preload it): it is already loaded."""
    serving.check_model(served_name(request.model))
    reason = "unload" if request.keep_alive in (0, "0") else "load"
    return JSONResponse({"model": request.model or serving.model_id, "created_at": timestamp(), **piece(Delta()),
                         "done": True, "done_reason": reason})


# -- the endpoints ------------------------------------------------------------------------------------


def ollama_endpoint(handler):
    """``handler(http, context)`` with its failures in Ollama's shape: ``{"error": "..."}``
    and the status; an unexpected one is a generic 500 (the traceback goes to the log)."""

    @functools.wraps(handler)
    async def run(http: HTTPRequest, context):
        try:
            return await handler(http, context)
        except APIError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        except Exception:
            log.exception("%s %s failed", http.method, http.url.path)
            error = internal_error()
            return JSONResponse({"error": error.message}, status_code=error.status)

    return run


@ollama_endpoint
async def chat(http: HTTPRequest, context) -> Response:
    request = parse_body(await context.body(http), OllamaChatRequest)
    async with serving_of(context.state, served_name(request.model) or None) as leased:  # until its rows are in
        serving = decoder_only(leased)
        if not request.messages:
            return loaded(request, serving, lambda delta: {"message": chat_piece(delta)})
        return await answer(http, serving, request, translated_chat(request), None,
                            lambda delta: {"message": chat_piece(delta)})


@ollama_endpoint
async def generate(http: HTTPRequest, context) -> Response:
    request = parse_body(await context.body(http), OllamaGenerateRequest)
    async with serving_of(context.state, served_name(request.model) or None) as leased:  # until its rows are in
        serving = decoder_only(leased)
        if not request.prompt:
            return loaded(request, serving, generate_piece)
        return await answer(http, serving, request, translated_generate(request),
                            request.prompt if request.raw else None, generate_piece)


def model_details(serving) -> dict:
    model_type = serving.model.args.model_type if isinstance(serving, EncoderServing) else serving.model_type
    return {"parent_model": "", "format": "safetensors", "family": model_type,
            "families": [model_type] if model_type else None, "parameter_size": "", "quantization_level": ""}


def model_entry(context, serving) -> dict:
    name = context.state.model_id
    return {"name": name, "model": name, "size": 0, "digest": "", "details": model_details(serving),
            "modified_at": datetime.fromtimestamp(context.state.created, timezone.utc).isoformat()}


def parameter_size(parameters: int | None) -> str:
    """Ollama's way to write a parameter count: "260K", "1.5B"."""
    if parameters is None:
        return ""
    for scale, letter in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{letter}"
    return str(parameters)


def local_entry(folder) -> dict:
    """/api/tags' entry of a --model-dir model that is not loaded (a catalog ModelFolder)."""
    modified = datetime.fromtimestamp(folder.path.stat().st_mtime, timezone.utc).isoformat()
    return {"name": folder.name, "model": folder.name, "size": folder.size_bytes, "digest": "", "modified_at": modified,
            "details": {"parent_model": "", "format": "safetensors", "family": folder.family,
                        "families": [folder.family], "parameter_size": parameter_size(folder.parameters),
                        "quantization_level": folder.quantization}}


def local_entries(context) -> list[dict]:
    """The loaded model, then (with --model-dir) the local ones a request may swap in."""
    entries = [model_entry(context, context.state.ready_serving())]
    swap = context.state.swap
    if swap is not None:
        from ..weights.catalog import describe_folder

        entries += [local_entry(describe_folder(path)) for name, path in swap.available().items()
                    if name != context.state.model_id]
    return entries


@ollama_endpoint
async def tags(http: HTTPRequest, context) -> Response:
    return JSONResponse({"models": await in_worker(local_entries, context)})


@ollama_endpoint
async def running(http: HTTPRequest, context) -> Response:
    serving = context.state.ready_serving()
    context_length = None if isinstance(serving, EncoderServing) else serving.context
    return JSONResponse({"models": [{**model_entry(context, serving), "size_vram": 0,
                                     "expires_at": "0001-01-01T00:00:00Z", "context_length": context_length}]})


def capabilities(encoder: bool, template: str) -> list[str]:
    if encoder:
        return ["embedding"]
    return ["completion", *(["tools"] if "tools" in template else []),
            *(["thinking"] if "<think>" in template or "enable_thinking" in template else [])]


def show_body(details: dict, encoder: bool, template: str, context_length: int | None, vocab_size: int,
              modified_at: str) -> dict:
    info = {"general.architecture": details["family"]}
    if not encoder:
        info.update({f"{details['family']}.context_length": context_length,
                     f"{details['family']}.vocab_size": vocab_size})
    return {"modelfile": "", "parameters": "", "template": template, "details": details, "model_info": info,
            "capabilities": capabilities(encoder, template), "modified_at": modified_at}


def folder_show(path) -> dict:
    """/api/show of a --model-dir model that is not loaded, read from its folder: as Ollama's
    show, it loads nothing (clients ask about every model they list; none of them is swapped in)."""
    from ..families import model_args_from_config
    from ..weights.catalog import chat_template_of, describe_folder

    folder = describe_folder(path)
    args = model_args_from_config(folder.config)
    entry = local_entry(folder)
    encoder = args.kind == "encoder"
    return show_body(entry["details"], encoder, "" if encoder else chat_template_of(path) or "",
                     args.max_position_embeddings, args.vocab_size, entry["modified_at"])


@ollama_endpoint
async def show(http: HTTPRequest, context) -> Response:
    request = parse_body(await context.body(http), ModelRequest)
    name = served_name(request.model or request.name)
    swap = context.state.swap
    if swap is not None and name != context.state.model_id and name in swap.available():
        return JSONResponse(await in_worker(folder_show, swap.available()[name]))
    serving = context.state.ready_serving()
    serving.check_model(name)
    encoder = isinstance(serving, EncoderServing)
    template = "" if encoder else serving.tokenizer.chat_template or ""
    return JSONResponse(show_body(model_details(serving), encoder, template, None if encoder else serving.context,
                                  0 if encoder else serving.vocab_size, model_entry(context, serving)["modified_at"]))


@ollama_endpoint
async def version(http: HTTPRequest, context) -> Response:
    return JSONResponse({"version": OLLAMA_API_VERSION})


@ollama_endpoint
async def pull(http: HTTPRequest, context) -> Response:
    """Offline: the served model (and every --model-dir one) is there already; any other is an error."""
    request = parse_body(await context.body(http), PullRequest)
    name = served_name(request.model or request.name)
    swap = context.state.swap
    local = swap is not None and name in swap.available()  # a --model-dir model: here already, loaded on use
    if name != context.state.model_id and not local:
        raise APIError(404, f"pulling {name!r} is not possible: this server downloads nothing and serves "
                       f"{context.state.model_id!r} (start mlx-tfm server --model with the model you want)")
    status = {"status": "success"}
    return Response(ndjson(status), media_type="application/x-ndjson") if request.stream else JSONResponse(status)


async def embedded(http: HTTPRequest, context, endpoint: str) -> tuple[EmbedRequest, dict]:
    """The OpenAI embeddings answer of an Ollama embed request (embeddings.py computes it)."""
    request = parse_body(await context.body(http), EmbedRequest)
    texts = request.prompt if endpoint == "POST /api/embeddings" else request.input
    body = {"model": served_name(request.model) or None, "input": texts, "encoding_format": "float",
            **({"dimensions": request.dimensions} if request.dimensions else {})}
    # an encoder has no engine to drain: its lease is what keeps it loaded while it embeds
    async with serving_of(context.state, served_name(request.model) or None) as leased:
        serving = encoder_only(leased, endpoint)
        return request, await in_worker(embeddings_response, serving, json.dumps(body).encode())


@ollama_endpoint
async def embed(http: HTTPRequest, context) -> Response:
    started = time.perf_counter_ns()
    request, result = await embedded(http, context, "POST /api/embed")
    return JSONResponse({"model": request.model or result["model"],
                         "embeddings": [item["embedding"] for item in result["data"]],
                         "total_duration": time.perf_counter_ns() - started, "load_duration": 0,
                         "prompt_eval_count": result["usage"]["prompt_tokens"]})


@ollama_endpoint
async def embeddings_legacy(http: HTTPRequest, context) -> Response:
    _, result = await embedded(http, context, "POST /api/embeddings")
    return JSONResponse({"embedding": result["data"][0]["embedding"]})


@ollama_endpoint
async def running_banner(http: HTTPRequest, context) -> Response:
    """What Ollama answers at its root: apps check it to find a server."""
    return PlainTextResponse("Ollama is running")


# (path, method, handler, the prefixes it answers under): app.py adds them to its ROUTES.
OLLAMA_ROUTES = (
    ("/", "GET", running_banner, ("",)),
    ("/api/chat", "POST", chat, ("",)),
    ("/api/generate", "POST", generate, ("",)),
    ("/api/tags", "GET", tags, ("",)),
    ("/api/ps", "GET", running, ("",)),
    ("/api/show", "POST", show, ("",)),
    ("/api/version", "GET", version, ("",)),
    ("/api/pull", "POST", pull, ("",)),
    ("/api/embed", "POST", embed, ("",)),
    ("/api/embeddings", "POST", embeddings_legacy, ("",)),
)

__all__ = ["OLLAMA_ROUTES", "OLLAMA_API_VERSION"]
