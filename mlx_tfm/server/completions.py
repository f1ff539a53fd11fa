"""The two completion endpoints, streaming and not: a request becomes rows of the engine
(``n`` choices; for legacy completions, ``n`` per prompt), the rows' events become OpenAI's
objects. A client that disconnects cancels its rows; a failure after the stream started
ends it with an error event (never a stream that does not end)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.images import ImageInputs
from ..engine.requests import Request
from ..generation.sampling import SamplingParams
from ..tokenizer import Tokenizer
from . import responses as objects
from .constrained import make_processor, response_grammar, tool_call_grammar
from .engine_client import Generation
from .errors import APIError, internal_error, invalid
from .output import (
    AnswerParser,
    Delta,
    HarmonyParser,
    ReasoningFormat,
    prompt_opens_thinking,
    reasoning_format_named,
    reasoning_format_of,
)
from .images import check_takes_images, image_bytes, image_inputs, image_prompt_ids
from .prompts import chat_prompt, check_prompt, text_prompt
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ImagePart,
    SamplingFields,
    parse_body,
)
from .fim import fim_prompt
from .settings import MAX_ROWS, ServerSettings
from .tool_formats import ToolFormat, markers_of, tool_format_named, tool_format_of
from .workers import in_worker

log = logging.getLogger("mlx_tfm.server")


@dataclass
class Serving:
    """What the endpoints need once the model is loaded."""

    engine: object
    tokenizer: Tokenizer
    model_id: str
    vocab_size: int  # the model's (ids at or past it are refused)
    context: int | None  # the longest prompt + answer (None: a rotating cache takes any length)
    settings: ServerSettings
    grammar_tokenizer: object  # llguidance's view of the tokenizer (None: no per-token bytes)
    texts: objects.TokenTexts
    scorer: Callable | None = None  # (ids, top) -> TokenScores (scoring.py); None: prompts cannot be scored
    stopping: threading.Event = field(default_factory=threading.Event)  # set at Ctrl-C / SIGTERM
    model_type: str = ""  # the architecture (Ollama's /api/show and /api/tags name it)

    def check_model(self, name: str | None) -> None:
        """A request may name the model by its id or by the --model argument as given."""
        if name and name not in (self.model_id, self.settings.model):
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


# -- engine requests ------------------------------------------------------------------------------


def sampling_of(request: SamplingFields, settings: ServerSettings, vocab_size: int, row: int) -> SamplingParams:
    """The row's sampling settings: the request's, else the server's defaults. Row ``i``
    of a seeded request gets seed + i, so the ``n`` choices differ but repeat."""
    bias = {int(token): value for token, value in (request.logit_bias or {}).items()}
    if any(not 0 <= token < vocab_size for token in bias):
        raise invalid("logit_bias", f"logit_bias names token ids outside the vocabulary of {vocab_size}")
    return SamplingParams(
        temp=settings.temp if request.temperature is None else request.temperature,
        top_p=settings.top_p if request.top_p is None else request.top_p,
        top_k=settings.top_k if request.top_k is None else request.top_k,
        min_p=settings.min_p if request.min_p is None else request.min_p,
        seed=None if request.seed is None else (request.seed + row) % 2**64,  # MLX keys take 64 bits
        repetition_penalty=request.repetition_penalty,
        repetition_context_size=request.repetition_context_size,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=bias or None,
    )


def token_limit(request: SamplingFields, settings: ServerSettings) -> int:
    return settings.max_tokens if request.token_limit is None else request.token_limit


# -- one choice of a chat answer ---------------------------------------------------------------------


class ChatChoice:
    """The answer of one row so far: parsed text, logprobs, and how it finished."""

    def __init__(self, parser: AnswerParser, serving: Serving, logprobs: bool, markers: dict[int, str] | None = None):
        self.parser = parser
        self.markers = markers or {}  # special token id -> the marker text the parser needs to see
        self.serving = serving
        self.answer = Delta()
        self.logprobs: list[dict] | None = [] if logprobs else None
        self.finish_reason: str | None = None
        self.tool_calls_sent = 0

    def add(self, event) -> tuple[Delta, list[dict]]:
        """What this event adds: the parsed delta and its logprob entries."""
        delta = self.parser.feed(self.markers.get(event.token, "") + event.text)
        if event.finish_reason is not None:
            delta += self.parser.finish()
        self.answer += delta
        entries = []
        if self.logprobs is not None and event.token is not None and event.logprob is not None \
                and event.token not in self.serving.tokenizer.eos_token_ids:
            entries.append(objects.chat_logprob(self.serving.texts, event.token, event.logprob, event.top_logprobs))
            self.logprobs += entries
        if event.finish_reason is not None:
            self.finish_reason = "tool_calls" if self.answer.tool_calls else event.finish_reason
        return delta, entries


class UsageCounter:
    """Usage of a request: each prompt counted once (its first row), every row's tokens."""

    def __init__(self, rows_per_prompt: int):
        self.rows_per_prompt = rows_per_prompt
        self.usage = objects.Usage()

    def add_final(self, row: int, event) -> None:
        self.usage.completion_tokens += event.generation_tokens
        if row % self.rows_per_prompt == 0:
            self.usage.prompt_tokens += event.prompt_tokens
            self.usage.cached_tokens += event.cached_tokens


def failed(serving: Serving, event) -> APIError | None:
    """An engine event that ends a row without an answer."""
    if event.finish_reason == "error" and serving.stopping.is_set():
        return APIError(503, event.error or "server shutting down", code="server_shutting_down")
    if event.finish_reason == "error" and event.internal:  # an exception's text: for the log, not the client
        log.error("a generation failed: %s", event.error)
        return APIError(500, "the generation failed: see the server log", code="generation_failed")
    if event.finish_reason == "error":
        return APIError(500, event.error or "the generation failed", code="generation_failed")
    if event.finish_reason == "cancelled":
        return APIError(500, "the generation was cancelled", code="cancelled")
    return None


# -- chat ------------------------------------------------------------------------------------------------


async def chat_completions(serving: Serving, http: HTTPRequest, body: bytes) -> Response:
    # Rendering, tokenizing and compiling a grammar take a while: off the event loop.
    request, rows, choices = await in_worker(prepare_chat, serving, body)
    generation = Generation(serving.engine, rows)
    if request.stream:
        return sse_response(chat_stream(serving, request, generation, choices), generation)
    return await answer_when_done(http, generation, lambda: chat_events(serving, generation, choices))


def prepare_chat(serving: Serving, body: bytes) -> tuple[ChatCompletionRequest, list[Request], list[ChatChoice]]:
    """The request, its engine rows (one per choice) and the choices' parsers."""
    return chat_rows(serving, parse_body(body, ChatCompletionRequest))


def chat_rows(serving: Serving, request: ChatCompletionRequest,
              raw_prompt: str | None = None) -> tuple[ChatCompletionRequest, list[Request], list[ChatChoice]]:
    """The engine rows and parsers of a parsed chat request (the Ollama and Anthropic APIs
    translate theirs into one). ``raw_prompt``: a text given as it is, with no chat template
    (Ollama's ``raw`` generate), encoded as a legacy completion's prompt."""
    serving.check_model(request.model)
    prompt_text, ids, images = prompt_of(serving, request, raw_prompt)
    check_prompt(ids, serving.vocab_size, serving.context, "messages")

    tool_format, reasoning = answer_formats(serving.settings, serving.tokenizer.chat_template, request)
    markers = special_markers(serving.tokenizer, markers_to_write(tool_format, reasoning))
    grammar, param = chat_grammar(request, tool_format, {text: token for token, text in markers.items()})
    rows = []
    for row in range(request.n):
        processors = (make_processor(serving.grammar_tokenizer, grammar, serving.vocab_size, param),) if grammar else ()
        rows.append(Request(prompt=ids, max_tokens=token_limit(request, serving.settings),
                            sampling=sampling_of(request, serving.settings, serving.vocab_size, row),
                            stop_strings=request.stop_strings, logprobs=request.logprobs,
                            top_logprobs=request.top_logprobs or 0, logits_processors=processors, images=images))
    # A grammar writes the answer from its first token: no thinking before it, whatever the prompt opened.
    starts_thinking = reasoning == ReasoningFormat.THINK and prompt_opens_thinking(prompt_text) and not grammar
    # An answer held to response_format is the JSON asked for, never a tool call.
    calls_format = None if param == "response_format" and grammar else tool_format
    schemas = {tool.function.name: tool.function.parameters or {} for tool in request.tools or []}
    choices = [ChatChoice(AnswerParser(starts_thinking, calls_format, schemas, reasoning), serving, request.logprobs,
                          markers) for _ in rows]
    return request, rows, choices


def prompt_of(serving: Serving, request: ChatCompletionRequest,
              raw_prompt: str | None = None) -> tuple[str, list[int], ImageInputs | None]:
    """(the prompt's text, its ids, its images or None): the chat template's rendering, or
    ``raw_prompt`` as it is; each image's placeholder written out as its tokens."""
    sources = request_images(serving, request)
    images = image_inputs(serving, sources) if sources else None  # every image refused or read before rendering
    prompt_text = chat_prompt(serving.tokenizer, request, serving.settings.chat_template_args) \
        if raw_prompt is None else raw_prompt
    if images is not None:
        return prompt_text, image_prompt_ids(serving, prompt_text, images, "messages"), images
    if raw_prompt is None:
        return prompt_text, serving.tokenizer.encode(prompt_text, add_special_tokens=False), None
    return prompt_text, text_prompt(serving.tokenizer, raw_prompt), None


def request_images(serving: Serving, request: ChatCompletionRequest) -> list[tuple[bytes | Path, str]]:
    """Every image part of the request's messages, in order: (its bytes or path, its field).
    A text-only model refuses the first part by its type."""
    parts = [(part.image_url.url, f"messages.{i}.content.{j}")
             for i, message in enumerate(request.messages) if isinstance(message.content, list)
             for j, part in enumerate(message.content) if isinstance(part, ImagePart)]
    if parts:
        check_takes_images(serving, f"{parts[0][1]}.type")
    allow_local = serving.settings.allow_local_images
    return [(image_bytes(url, f"{param}.image_url.url", allow_local), f"{param}.image_url") for url, param in parts]


def answer_formats(settings: ServerSettings, template: str | None,
                   request: ChatCompletionRequest) -> tuple[ToolFormat | None, ReasoningFormat]:
    """The answer's tool call format (None: the request offers no tools) and where its
    reasoning is: the server's --tool-call-parser / --reasoning-parser, else the chat
    template's."""
    tool_format = None
    if request.tools and request.tool_choice != "none":
        named = settings.tool_call_parser
        tool_format = tool_format_named(named) if named else tool_format_of(template)
    named = settings.reasoning_parser
    return tool_format, reasoning_format_named(named) if named else reasoning_format_of(template)


def markers_to_write(tool_format: ToolFormat | None, reasoning: ReasoningFormat) -> tuple[str, ...]:
    """The markers the answer's parsers read (only theirs: another model's marker, such as
    Phi-3's <|end|>, stays out of its text)."""
    markers = markers_of(tool_format) if tool_format is not None else ()
    if reasoning == ReasoningFormat.HARMONY or tool_format == ToolFormat.HARMONY:
        markers += HarmonyParser.MARKERS
    return markers


@functools.lru_cache(maxsize=64)
def special_markers(tokenizer: Tokenizer, markers: tuple[str, ...]) -> dict[int, str]:
    """Id -> text of the ``markers`` that are special tokens: they stream as no text (as
    gpt-oss's <|channel|> or Kimi's <|tool_call_begin|>), so the parser is given them."""
    found = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and not tokenizer.decode(ids):  # one token, and decoding skips it: special
            found[ids[0]] = marker
    return found


def chat_grammar(request: ChatCompletionRequest, tool_format: ToolFormat | None,
                 special: dict[str, int]) -> tuple[str | None, str]:
    """The grammar the answer must follow, and the field that asked for it (``special``:
    the format's markers that are special tokens, text -> id)."""
    forced_call = tool_call_grammar(request, tool_format, special) if tool_format is not None else None
    if forced_call is not None:
        if request.response_format is not None and request.response_format.type != "text":
            raise invalid("response_format", "response_format cannot be combined with a forced tool call")
        return forced_call, "tool_choice"
    return response_grammar(request), "response_format"


async def chat_events(serving: Serving, generation: Generation, choices: list[ChatChoice]) -> dict:
    usage = UsageCounter(rows_per_prompt=len(choices))
    async for row, event in generation.events():
        error = failed(serving, event)
        if error is not None:
            generation.cancel()
            raise error
        choices[row].add(event)
        if event.finish_reason is not None:
            usage.add_final(row, event)
    return objects.chat_completion(
        objects.completion_id("chatcmpl"), serving.model_id, objects.now(),
        [objects.chat_choice(i, c.answer, c.finish_reason, c.logprobs) for i, c in enumerate(choices)], usage.usage,
    )


async def chat_stream(serving: Serving, request: ChatCompletionRequest, generation: Generation,
                      choices: list[ChatChoice]) -> AsyncIterator[dict]:
    response_id, created = objects.completion_id("chatcmpl"), objects.now()
    usage = UsageCounter(rows_per_prompt=len(choices))

    def chunk(choice: dict) -> dict:
        return objects.chat_chunk(response_id, serving.model_id, created, [choice], request.include_usage)

    for index in range(len(choices)):
        yield chunk(objects.chat_chunk_choice(index, {"role": "assistant", "content": ""}))
    async for row, event in generation.events():
        error = failed(serving, event)
        if error is not None:
            generation.cancel()
            raise error
        choice = choices[row]
        delta, logprobs = choice.add(event)
        body = objects.chat_delta(delta, choice.tool_calls_sent)
        choice.tool_calls_sent += len(delta.tool_calls)
        if body or logprobs:
            yield chunk(objects.chat_chunk_choice(row, body, None, logprobs))
        if event.finish_reason is not None:
            usage.add_final(row, event)
            yield chunk(objects.chat_chunk_choice(row, {}, choice.finish_reason))
    if request.include_usage:
        yield objects.usage_chunk(response_id, serving.model_id, created, "chat.completion.chunk", usage.usage)


async def answer_deltas(serving: Serving, generation: Generation,
                        choice: ChatChoice) -> AsyncIterator[tuple[Delta, list[dict], object]]:
    """The parsed delta and logprob entries of each engine event of a one-choice chat
    answer, with the event (the Ollama and Anthropic APIs shape these); a failed row raises
    its APIError."""
    async for _, event in generation.events():
        error = failed(serving, event)
        if error is not None:
            generation.cancel()
            raise error
        delta, logprobs = choice.add(event)
        yield delta, logprobs, event


# -- legacy completions ---------------------------------------------------------------------------------


class TextChoice:
    """The text of one row so far (the echoed prompt first), its logprobs (the echoed
    prompt's first, when scored), and how it finished. ``score_only``: ``max_tokens: 0``,
    finished before it starts; ``prompt_tokens`` then counts its prompt in the usage."""

    def __init__(self, echo: str, logprobs: objects.LegacyLogprobs | None, score_only: bool = False,
                 prompt_tokens: int = 0):
        self.text = echo
        self.logprobs = logprobs
        self.echo_logprobs = copy_logprobs(logprobs) if logprobs is not None else None  # for the stream's first chunk
        self.finish_reason: str | None = "length" if score_only else None
        self.prompt_tokens = prompt_tokens if score_only else 0

    def add(self, serving: Serving, event) -> objects.LegacyLogprobs | None:
        """Add the event's text; return its logprobs (for a stream chunk)."""
        added = None
        if self.logprobs is not None and event.token is not None and event.logprob is not None \
                and event.token not in serving.tokenizer.eos_token_ids:
            added = objects.LegacyLogprobs()
            added.add(serving.texts, event.token, event.logprob, event.top_logprobs, len(self.text))
            self.logprobs.add(serving.texts, event.token, event.logprob, event.top_logprobs, len(self.text))
        self.text += event.text
        self.finish_reason = event.finish_reason
        return added


async def completions(serving: Serving, http: HTTPRequest, body: bytes) -> Response:
    request, rows, choices = await in_worker(prepare_completion, serving, body)
    generation = Generation(serving.engine, rows)
    if request.stream:
        return sse_response(text_stream(serving, request, generation, choices), generation)
    return await answer_when_done(http, generation, lambda: text_events(serving, request, generation, choices))


def prepare_completion(serving: Serving, body: bytes) -> tuple[CompletionRequest, list[Request], list[TextChoice]]:
    """The request and its engine rows: ``n`` per prompt, in order (choice index = row)."""
    request = parse_body(body, CompletionRequest)
    serving.check_model(request.model)
    prompts = completion_prompts(serving, request)
    if len(prompts) * request.n > MAX_ROWS:
        raise invalid("n", f"n x prompts is {len(prompts) * request.n} choices; a request may ask for at most {MAX_ROWS}")
    score_only = request.max_tokens == 0  # the prompt scored (with echo), nothing generated
    rows, choices = [], []
    for p, (prompt, ids) in enumerate(prompts):
        check_prompt(ids, serving.vocab_size, serving.context, "prompt" if len(prompts) == 1 else f"prompt.{p}")
        echo = (prompt if isinstance(prompt, str) else serving.tokenizer.decode(prompt)) if request.echo else ""
        wanted = request.logprobs is not None
        echoed = echo_logprobs(serving, ids, echo, request.logprobs) if request.echo and wanted else None
        for i in range(request.n):
            logprobs = (copy_logprobs(echoed) if echoed else objects.LegacyLogprobs()) if wanted else None
            choices.append(TextChoice(echo, logprobs, score_only, len(ids)))
            if not score_only:
                rows.append(Request(prompt=ids, max_tokens=token_limit(request, serving.settings),
                                    sampling=sampling_of(request, serving.settings, serving.vocab_size, i),
                                    stop_strings=request.stop_strings, logprobs=request.logprobs is not None,
                                    top_logprobs=request.logprobs or 0))
    return request, rows, choices


def completion_prompts(serving: Serving, request: CompletionRequest) -> list[tuple[str | list[int], list[int]]]:
    """Each prompt and its ids; with ``suffix``, the prompt and the suffix laid out in the
    model's fill-in-the-middle format (server/fim.py)."""
    if request.suffix is None:
        return [(prompt, text_prompt(serving.tokenizer, prompt)) for prompt in request.prompts()]
    prompts = []
    for p, prompt in enumerate(request.prompts()):
        if not isinstance(prompt, str):
            raise invalid("prompt", "suffix needs the prompt as text (the prefix to fill in after)")
        prompts.append((prompt, fim_prompt(serving.tokenizer, prompt, request.suffix)))
    return prompts


def echo_logprobs(serving: Serving, ids: list[int], echo: str, top: int) -> objects.LegacyLogprobs:
    """The echoed prompt's logprobs, with ``top`` alternatives. Each token's offset is
    where it starts in the echoed text: the length of the text decoded so far."""
    if serving.scorer is None:
        raise invalid("echo", "this server cannot score prompts (a model split over ranks): echo with logprobs "
                      "is not available")
    scores = serving.scorer(ids, top)
    logprobs = objects.LegacyLogprobs()
    for i, score in enumerate(scores):
        offset = min(len(serving.tokenizer.decode(ids[:i])), len(echo))
        if score.logprob is None:
            logprobs.add_unpredicted(serving.texts, score.token, offset)
        else:
            logprobs.add(serving.texts, score.token, score.logprob, score.top, offset)
    return logprobs


def copy_logprobs(logprobs: objects.LegacyLogprobs) -> objects.LegacyLogprobs:
    """A choice's own copy (each of ``n`` choices appends its own tokens)."""
    return objects.LegacyLogprobs(list(logprobs.tokens), list(logprobs.token_logprobs), list(logprobs.top_logprobs),
                                  list(logprobs.text_offset))


async def text_events(serving: Serving, request: CompletionRequest, generation: Generation,
                      choices: list[TextChoice]) -> dict:
    usage = score_only_usage(request, choices)
    async for row, event in generation.events():
        error = failed(serving, event)
        if error is not None:
            generation.cancel()
            raise error
        choices[row].add(serving, event)
        if event.finish_reason is not None:
            usage.add_final(row, event)
    return objects.text_completion(
        objects.completion_id("cmpl"), serving.model_id, objects.now(),
        [objects.text_choice(i, c.text, c.finish_reason, c.logprobs) for i, c in enumerate(choices)], usage.usage,
    )


async def text_stream(serving: Serving, request: CompletionRequest, generation: Generation,
                      choices: list[TextChoice]) -> AsyncIterator[dict]:
    response_id, created = objects.completion_id("cmpl"), objects.now()
    usage = score_only_usage(request, choices)

    def chunk(index: int, text: str, finish_reason: str | None, logprobs) -> dict:
        # No "usage": null before the last chunk (the chat chunks' way): here the spec's usage is not nullable.
        return objects.text_completion(response_id, serving.model_id, created,
                                       [objects.text_choice(index, text, finish_reason, logprobs)], None)

    for index, choice in enumerate(choices):
        if choice.text or choice.finish_reason:  # the echoed prompt (and its logprobs); a score-only choice
            yield chunk(index, choice.text, choice.finish_reason, choice.echo_logprobs)
    async for row, event in generation.events():
        error = failed(serving, event)
        if error is not None:
            generation.cancel()
            raise error
        logprobs = choices[row].add(serving, event)
        if event.text or logprobs is not None or event.finish_reason is not None:
            yield chunk(row, event.text, event.finish_reason, logprobs)
        if event.finish_reason is not None:
            usage.add_final(row, event)
    if request.include_usage:
        yield objects.usage_chunk(response_id, serving.model_id, created, "text_completion", usage.usage)


def score_only_usage(request: CompletionRequest, choices: list[TextChoice]) -> UsageCounter:
    """The usage counter, holding already the prompts of score-only choices (no engine
    event will report them)."""
    usage = UsageCounter(rows_per_prompt=request.n)
    usage.usage.prompt_tokens = sum(choice.prompt_tokens for choice in choices[::request.n])
    return usage


# -- delivery ---------------------------------------------------------------------------------------------


async def answer_when_done(http: HTTPRequest, generation: Generation, collect: Callable) -> Response:
    """Wait for the whole answer, or for the client to leave (then its rows are cancelled)."""
    answer = asyncio.ensure_future(collect())
    left = asyncio.ensure_future(wait_for_disconnect(http))
    try:
        await asyncio.wait({answer, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not answer.done():
            answer.cancel()
            generation.cancel()
    if not answer.done() or answer.cancelled():
        return Response(status_code=499)  # nobody is there to read it
    return JSONResponse(answer.result())


async def wait_for_disconnect(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def sse_response(chunks: AsyncIterator[dict], generation: Generation) -> StreamingResponse:
    return StreamingResponse(server_sent_events(chunks, generation), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def server_sent_events(chunks: AsyncIterator[dict], generation: Generation) -> AsyncIterator[bytes]:
    """``data: {json}`` events, then ``data: [DONE]``; a failure becomes an error event
    that ends the stream (the openai client raises it). A client that leaves cancels the
    stream (Starlette cancels this generator): its rows are cancelled too."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as e:
        log.warning("stream ended with an error: %s", e.message)
        yield sse(e.body())
        return
    except Exception:  # the traceback to the log, one line to the client
        log.exception("a streamed completion failed")
        yield sse(internal_error().body())
        return
    finally:
        generation.cancel()
    yield b"data: [DONE]\n\n"


def framed_stream(chunks: AsyncIterator[dict], generation: Generation, frame: Callable[[dict], bytes],
                  error_frame: Callable[[APIError], bytes], media_type: str) -> StreamingResponse:
    """A stream in another API's framing (Ollama's NDJSON lines, Anthropic's typed events):
    each chunk through ``frame``; a failure ends it with ``error_frame`` (one line to the
    client, the traceback to the log); the rows are cancelled when it ends or the client leaves."""

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield frame(chunk)
        except APIError as e:
            log.warning("stream ended with an error: %s", e.message)
            yield error_frame(e)
        except Exception:
            log.exception("a streamed answer failed")
            yield error_frame(internal_error())
        finally:
            generation.cancel()

    return StreamingResponse(frames(), media_type=media_type, headers={"Cache-Control": "no-cache",
                                                                         "X-Accel-Buffering": "no"})


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


__all__ = ["Serving", "chat_completions", "completions"]
