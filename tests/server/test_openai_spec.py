"""The server against OpenAI's published OpenAPI spec (tests/fixtures/openai_spec.py), as a
client author would check it: every answer and stream chunk validates against the spec's
response schemas; spec-valid requests are served (``null`` for a nullable field is its
default, ``n`` up to 128, ``max_tokens: 0``); bodies that are not valid requests
(malformed, nested too deep, lone surrogates, cut short) are OpenAI-shaped 400s, or for a
client that hung up, counted as 499 and logged without a traceback.

A scripted server (tests/fixtures/scripted_server.py: the real app over an engine that
answers a set script) covers the shapes; `mlx-tfm server` on stories260K covers what needs
the model: score mode's logprobs (against transformers' log-softmax), a request line
uvicorn cannot parse, and the model named by its --model argument."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import sentencepiece

from fixtures.openai_spec import assert_spec_valid, assert_stream_valid, spec_errors
from fixtures.scripted_server import ScriptedServer, scripted_tokenizer_folder
from fixtures.server_process import served

CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    server = ScriptedServer(scripted_tokenizer_folder(tmp_path_factory.mktemp("spec") / "tokenizer", []))
    server.engine.script = ["Hello", " world", "!"]
    server.engine.metrics = lambda: None  # /metrics without the engine's part
    yield server
    server.close()


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as client:
        yield client


def sse_events(response: httpx.Response) -> list:
    """The data of every event of a stream, "[DONE]" included as a string."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.iter_lines() if line.startswith("data: ")]


def stream(http: httpx.Client, url: str, body: dict) -> list:
    with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response)


def test_the_spec_helper_finds_what_the_server_used_to_break():
    """The checker itself: a missing refusal and a null system_fingerprint are errors; a
    nullable field's null is not."""
    message = {"role": "assistant", "content": "hi"}
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]}
    errors = spec_errors(body, "CreateChatCompletionResponse")
    assert len(errors) == 2 and any("refusal" in e for e in errors) and any("system_fingerprint" in e for e in errors)
    del body["system_fingerprint"]
    message["refusal"] = None
    assert spec_errors(body, "CreateChatCompletionResponse") == []


# -- every answer validates ---------------------------------------------------------------------------------


def test_chat_answers_and_chunks_validate(scripted, http):
    url = scripted.url + "/chat/completions"
    answer = http.post(url, json={"messages": CHAT, "n": 2}).json()
    assert_spec_valid(answer, "CreateChatCompletionResponse")
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hello world!", "refusal": None}
    events = stream(http, url, {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3
    assert_stream_valid(events, "CreateChatCompletionStreamResponse")


def test_completion_answers_and_chunks_validate(scripted, http):
    url = scripted.url + "/completions"
    answer = http.post(url, json={"prompt": ["One", "Two"], "echo": True, "n": 2}).json()
    assert_spec_valid(answer, "CreateCompletionResponse")
    assert [c["text"] for c in answer["choices"]] == ["OneHello world!"] * 2 + ["TwoHello world!"] * 2
    events = stream(http, url, {"prompt": "One", "stream": True, "stream_options": {"include_usage": True}})
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "Hello world!"
    assert_stream_valid(events, "CreateCompletionResponse")


def test_models_and_errors_validate(scripted, http):
    assert_spec_valid(http.get(scripted.url + "/models").json(), "ListModelsResponse")
    assert_spec_valid(http.get(scripted.url + "/models/scripted-model").json(), "Model")
    missing = http.get(scripted.url + "/models/no-such-model")
    assert missing.status_code == 404
    assert_spec_valid(missing.json(), "ErrorResponse")


# -- spec-valid requests are served ----------------------------------------------------------------------

CHAT_NULLABLE = ["n", "stream", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "max_tokens",
                 "max_completion_tokens", "temperature", "top_p", "seed", "stop", "logit_bias", "stream_options",
                 "response_format", "tools", "tool_choice"]
COMPLETION_NULLABLE = ["n", "stream", "logprobs", "presence_penalty", "frequency_penalty", "echo", "max_tokens",
                       "temperature", "top_p", "seed", "logit_bias", "suffix", "stream_options", "best_of"]


@pytest.mark.parametrize("field", CHAT_NULLABLE)
def test_null_is_the_default_of_a_chat_field(scripted, http, field):
    response = http.post(scripted.url + "/chat/completions", json={"messages": CHAT, field: None})
    assert response.status_code == 200, response.text
    answer = assert_spec_valid(response.json(), "CreateChatCompletionResponse")
    assert [c["message"]["content"] for c in answer["choices"]] == ["Hello world!"]


@pytest.mark.parametrize("field", COMPLETION_NULLABLE)
def test_null_is_the_default_of_a_completion_field(scripted, http, field):
    response = http.post(scripted.url + "/completions", json={"prompt": "One", field: None})
    assert response.status_code == 200, response.text
    answer = assert_spec_valid(response.json(), "CreateCompletionResponse")
    assert [(c["text"], c["logprobs"]) for c in answer["choices"]] == [("Hello world!", None)]


def test_a_null_prompt_is_the_start_of_a_document(scripted, http):
    """The spec's default prompt is <|endoftext|>, a document's start: the BOS token where the
    tokenizer adds one; this one adds none, so the prompt is empty."""
    response = http.post(scripted.url + "/completions", json={"prompt": None})
    assert response.status_code == 400 and response.json()["error"]["message"] == "the prompt is empty"


def test_n_goes_up_to_the_specs_bound(scripted, http):
    answer = http.post(scripted.url + "/chat/completions", json={"messages": CHAT, "n": 128}).json()
    assert [c["index"] for c in assert_spec_valid(answer, "CreateChatCompletionResponse")["choices"]] == list(range(128))
    too_many = http.post(scripted.url + "/chat/completions", json={"messages": CHAT, "n": 129})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    rows = http.post(scripted.url + "/completions", json={"prompt": ["a"] * 3, "n": 128})
    assert rows.status_code == 400 and "at most 256" in rows.json()["error"]["message"]


def test_max_tokens_0_without_echo_is_an_empty_completion(scripted, http):
    answer = http.post(scripted.url + "/completions", json={"prompt": "One", "max_tokens": 0}).json()
    assert_spec_valid(answer, "CreateCompletionResponse")
    assert [(c["text"], c["finish_reason"]) for c in answer["choices"]] == [("", "length")]
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] > 0


def test_echo_with_logprobs_on_a_server_that_cannot_score_is_a_400(scripted, http):
    """The scripted server has no model to score with, as a model split over ranks has none."""
    body = {"prompt": "One", "max_tokens": 0, "echo": True, "logprobs": 1}
    response = http.post(scripted.url + "/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    assert "cannot score prompts" in response.json()["error"]["message"]


def test_a_request_may_name_the_model_by_its_argument(scripted, http):
    """ScriptedServer's --model is "scripted-model", the id too; the stories server below
    checks a path that differs from its id."""
    response = http.post(scripted.url + "/completions", json={"model": "scripted-model", "prompt": "One"})
    assert response.status_code == 200


# -- bodies that are not requests ----------------------------------------------------------------------------

BAD_BODIES = {
    "malformed": (b'{"messages": [', "body"),
    "deeply nested": (b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "body"),
    "not UTF-8": (b'{"messages": [{"role": "user", "content": "\xff"}]}', "body"),
    "lone surrogate in a message": (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    "lone surrogate in a part": (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
                                 "messages.0.content.0.text"),
    "lone surrogate in a key": (b'{"messages": [{"role": "user", "content": "a"}], "x\\ud800": 1}', "body"),
}


@pytest.mark.parametrize("name", BAD_BODIES)
def test_a_body_that_is_no_request_is_an_openai_400(scripted, http, name):
    body, param = BAD_BODIES[name]
    response = http.post(scripted.url + "/chat/completions", content=body)
    assert response.status_code == 400, response.text
    error = assert_spec_valid(response.json(), "ErrorResponse")["error"]
    assert (error["param"] or "body") == param and "\n" not in error["message"]


def test_a_lone_surrogate_in_a_prompt_is_a_400(scripted, http):
    response = http.post(scripted.url + "/completions", content=b'{"prompt": ["ok", "\\ud800"]}')
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt.1"


def test_a_client_that_hangs_up_mid_body_is_counted_as_cancelled(scripted, http, caplog):
    host, port = scripted.url.split("//")[1].split("/")[0].split(":")
    with caplog.at_level(logging.INFO, logger="mlx_tfm.server"):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"pro")
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while 'path="/v1/completions",status="499"' not in (text := http.get(scripted.url[:-3] + "/metrics").text):
            assert time.monotonic() < deadline, text
            time.sleep(0.05)
    assert 'status="500"' not in text
    records = [r for r in caplog.records if r.name == "mlx_tfm.server"]
    assert records and all(r.levelno < logging.ERROR and r.exc_info is None for r in records)


# -- the stories260K server ------------------------------------------------------------------------------------

SCORED = "Once upon a time there was a little dog"


@pytest.fixture(scope="module")
def stories(stories_hf):
    yield from served("--model", str(stories_hf), "--max-tokens", "8", "--log-level", "warning")


@pytest.fixture(scope="module")
def reference_logprobs(stories_hf):
    """transformers' log-softmax over the scored prompt: (ids, (L, V) logprobs)."""
    import torch
    from transformers import LlamaForCausalLM

    sp = sentencepiece.SentencePieceProcessor(model_file=str(stories_hf / "tokenizer.model"))
    ids = [sp.bos_id()] + sp.encode(SCORED)
    model = LlamaForCausalLM.from_pretrained(str(stories_hf), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits, dim=-1).numpy()


def test_max_tokens_0_with_echo_scores_the_prompt(stories, http, reference_logprobs):
    ids, reference = reference_logprobs
    body = {"prompt": SCORED, "max_tokens": 0, "echo": True, "logprobs": 3}
    answer = assert_spec_valid(http.post(stories.url + "/completions", json=body).json(), "CreateCompletionResponse")
    choice = answer["choices"][0]
    assert choice["text"] == SCORED and choice["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] == len(ids) and answer["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    expected = [reference[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(logprobs["token_logprobs"][1:], expected, atol=1e-4)
    for i, top in enumerate(logprobs["top_logprobs"][1:], start=1):
        np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(reference[i - 1])[::-1][:3], atol=1e-4)
    # Each token starts at its offset in the echoed text (BOS and the first word, whose space
    # the text does not hold, at 0).
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert offsets[:2] == [0, 0] and all(SCORED[o:].startswith(t) for o, t in zip(offsets[2:], tokens[2:]))


def test_echo_with_logprobs_scores_the_prompt_then_the_answer(stories, http):
    score = {"prompt": SCORED, "max_tokens": 0, "echo": True, "logprobs": 1}
    scored = http.post(stories.url + "/completions", json=score).json()["choices"][0]["logprobs"]
    answer = http.post(stories.url + "/completions", json={**score, "max_tokens": 4}).json()
    logprobs = assert_spec_valid(answer, "CreateCompletionResponse")["choices"][0]["logprobs"]
    n = len(scored["tokens"])
    assert len(logprobs["tokens"]) == n + 4 and logprobs["tokens"][:n] == scored["tokens"]
    np.testing.assert_allclose(logprobs["token_logprobs"][1:n], scored["token_logprobs"][1:], atol=1e-5)
    assert logprobs["text_offset"][n] == len(SCORED)  # the answer starts where the echo ends


def test_a_streamed_score_is_one_chunk(stories, http):
    events = stream(http, stories.url + "/completions",
                    {"prompt": SCORED, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True})
    assert_stream_valid(events, "CreateCompletionResponse")
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["choices"][0]["text"] == SCORED and events[0]["choices"][0]["finish_reason"] == "length"


def test_the_model_may_be_named_by_its_path(stories, http, stories_hf):
    body = {"model": str(stories_hf), "prompt": "Once", "max_tokens": 2}
    assert http.post(stories.url + "/completions", json=body).status_code == 200
    assert http.get(stories.url + "/models/" + str(stories_hf).lstrip("/")).status_code == 404  # a path, not an id
    assert http.get(stories.url + "/models/" + stories_hf.name).status_code == 200


def test_a_garbage_request_line_gets_an_openai_body(stories):
    host, port = stories.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    assert_spec_valid(json.loads(body), "ErrorResponse")


def test_scores_while_the_engine_generates_equal_scores_alone(stories):
    """Scoring runs beside the engine's thread: its answers must not change for that."""
    score = {"prompt": SCORED * 10, "max_tokens": 0, "echo": True, "logprobs": 2}
    alone = httpx.post(stories.url + "/completions", json=score, timeout=60).json()["choices"][0]["logprobs"]
    results = []

    def post(body):
        results.append(httpx.post(stories.url + "/completions", json=body, timeout=120))

    threads = [threading.Thread(target=post, args=({"prompt": [1], "max_tokens": 300},)) for _ in range(3)]
    threads += [threading.Thread(target=post, args=(score,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r.status_code == 200 for r in results)
    scored = [r.json()["choices"][0]["logprobs"] for r in results if r.json()["usage"]["completion_tokens"] == 0]
    assert scored == [alone] * 4
