"""``POST /infill``, in llama-server's shape (what editor plugins such as llama.vim and
llama.vscode send): the code before and after the cursor (``input_prefix``,
``input_suffix``), other files of the project (``input_extra``), and ``prompt``, the start
of the middle already typed. The answer is ``{"content", "stop", ...}``; a stream is
``data: {"content": piece, "stop": false}`` events, the last one with ``"stop": true``
(no ``[DONE]``: llama-server's own endpoints send none)."""

from __future__ import annotations

import json
from typing import AsyncIterator

from pydantic import Field
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.requests import Request
from .completions import Serving, answer_when_done, failed, sampling_of
from .engine_client import Generation
from .errors import APIError
from .fim import ExtraFile, fim_prompt
from .prompts import check_prompt
from .protocol import Lenient, SamplingFields, parse_body
from .workers import in_worker


class ExtraFileField(Lenient):
    filename: str = ""
    text: str = ""


class InfillRequest(SamplingFields):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFileField] = Field(default_factory=list)
    prompt: str = ""  # the middle's start, already typed: it follows the middle marker
    n_predict: int | None = Field(default=None, ge=-1)  # llama-server's max_tokens; -1: the server's limit

    @property
    def token_limit(self) -> int | None:
        if self.n_predict is not None and self.n_predict >= 0:
            return self.n_predict
        return self.max_tokens


def prepare_infill(serving: Serving, body: bytes) -> tuple[InfillRequest, Request]:
    """The request and its one engine row (``n`` is not part of llama-server's infill)."""
    request = parse_body(body, InfillRequest)
    serving.check_model(request.model)
    extra = tuple(ExtraFile(file.filename, file.text) for file in request.input_extra)
    ids = fim_prompt(serving.tokenizer, request.input_prefix, request.input_suffix, extra, param="input_prefix")
    ids += serving.tokenizer.encode(request.prompt, add_special_tokens=False) if request.prompt else []
    check_prompt(ids, serving.vocab_size, serving.context, "input_prefix")
    limit = serving.settings.max_tokens if request.token_limit is None else request.token_limit
    if limit == 0:
        raise APIError(400, "n_predict: at least 1 token to fill in", param="n_predict", code="invalid_value")
    row = Request(prompt=ids, max_tokens=limit, sampling=sampling_of(request, serving.settings, serving.vocab_size, 0),
                  stop_strings=request.stop_strings)
    return request, row


async def infill(serving: Serving, http: HTTPRequest, body: bytes) -> Response:
    request, row = await in_worker(prepare_infill, serving, body)
    generation = Generation(serving.engine, [row])
    if request.stream:
        return StreamingResponse(infill_stream(serving, generation), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await answer_when_done(http, generation, lambda: infill_answer(serving, generation))


def final_fields(serving: Serving, event) -> dict:
    """What llama-server reports with the last piece."""
    return {"stop": True, "model": serving.model_id, "finish_reason": event.finish_reason,
            "tokens_predicted": event.generation_tokens, "tokens_evaluated": event.prompt_tokens, "truncated": False}


async def infill_answer(serving: Serving, generation: Generation) -> dict:
    pieces = []
    async for _, event in generation.events():
        error = failed(serving, event)
        if error is not None:
            generation.cancel()
            raise error
        pieces.append(event.text)
        if event.finish_reason is not None:
            return {"content": "".join(pieces), **final_fields(serving, event)}
    raise APIError(500, "the generation ended without a last event", code="generation_failed")


async def infill_stream(serving: Serving, generation: Generation) -> AsyncIterator[bytes]:
    """The pieces as they come; a failure ends the stream with an error event."""
    try:
        async for _, event in generation.events():
            error = failed(serving, event)
            if error is not None:
                yield infill_event(error.body())
                return
            last = final_fields(serving, event) if event.finish_reason is not None else {"stop": False}
            yield infill_event({"content": event.text, **last})
    finally:
        generation.cancel()


def infill_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"
