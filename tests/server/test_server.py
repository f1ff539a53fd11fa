"""`mlx-tfm server` on stories260K, driven over HTTP by the real openai client
(max_retries=0) and by httpx for raw server-sent events and error bodies.

References: the golden greedy ids of llama2.c (decoded by sentencepiece), mlx-lm's
log-softmax for logprobs, in-process ``mlx_tfm.generation`` for cold runs, and sequential
requests for concurrent ones."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import sentencepiece

from fixtures.openai_spec import spec_checking_http_client
from fixtures.server_process import served

CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(stories_hf):
    yield from served("--model", str(stories_hf), "--max-tokens", "32", "--log-level", "warning")


@pytest.fixture(scope="module")
def client(server):
    # every JSON answer is checked against OpenAI's spec on the way (fixtures/openai_spec.py)
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, http_client=spec_checking_http_client())


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def sp(stories_hf):
    return sentencepiece.SentencePieceProcessor(model_file=str(stories_hf / "tokenizer.model"))


def sse_events(response: httpx.Response) -> list:
    """The data of every event of a stream, "[DONE]" included as a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- objects and usage ---------------------------------------------------------------------------


def test_developer_messages_are_system_messages(client, model_id):
    def answer(role):
        return client.chat.completions.create(model=model_id, max_tokens=12, messages=[
            {"role": role, "content": "You tell stories about dogs."}, *CHAT]).choices[0].message.content

    assert answer("developer") == answer("system")


def test_models_list(client, stories_hf):
    models = client.models.list().data
    assert [m.id for m in models] == [stories_hf.name] and models[0].object == "model"
    assert client.models.retrieve(stories_hf.name).id == stories_hf.name


def test_completion_reproduces_the_golden_greedy_text(client, model_id, golden, sp):
    """Prompt = BOS id; the text is what llama2.c generates (decoded by sentencepiece)."""
    completion = client.completions.create(model=model_id, prompt=[1], max_tokens=60, temperature=0)
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert choice.text == sp.decode(golden["generated_ids"][:60])
    assert choice.finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (1, 60, 61)


def test_chat_object_and_usage(client, model_id, stories_hf):
    from mlx_tfm.tokenizer import load_tokenizer

    completion = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=10)
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == model_id and completion.created > 0
    choice = completion.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    usage = completion.usage
    expected_prompt = len(load_tokenizer(stories_hf).apply_chat_template(CHAT, add_generation_prompt=True))
    assert usage.prompt_tokens == expected_prompt and usage.completion_tokens == 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    raw = httpx.post(f"{client.base_url}chat/completions", json={"messages": CHAT, "max_tokens": 3}).json()
    assert set(raw) >= {"id", "object", "created", "model", "choices", "usage"}
    assert set(raw["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}


def test_routes_without_the_v1_prefix(server):
    assert httpx.get(f"{server.root}/models").json()["data"][0]["object"] == "model"
    body = httpx.post(f"{server.root}/chat/completions", json={"messages": CHAT, "max_tokens": 2}).json()
    assert body["object"] == "chat.completion"
    body = httpx.post(f"{server.root}/completions", json={"prompt": "Once", "max_tokens": 2}).json()
    assert body["object"] == "text_completion"


def test_max_tokens_gives_length_and_default_limit(client, model_id):
    completion = client.chat.completions.create(model=model_id, messages=CHAT, max_completion_tokens=7)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 7
    default = client.chat.completions.create(model=model_id, messages=CHAT)  # --max-tokens 32
    assert default.usage.completion_tokens == 32


def test_stop_string_is_excluded_and_gives_stop(client, model_id, golden, sp):
    full = sp.decode(golden["generated_ids"][:80])
    assert "Lily" in full
    completion = client.completions.create(model=model_id, prompt=[1], max_tokens=80, stop=["Lily", "zebra"])
    assert completion.choices[0].text == full[: full.index("Lily")]
    assert completion.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=40, stop=" ")
    assert " " not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"


def test_greedy_and_seeded_sampling_repeat(client, model_id):
    def answer(**kwargs):
        return client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, **kwargs).choices[0].message.content

    assert answer(temperature=0) == answer(temperature=0)
    seeded = answer(temperature=1.0, seed=1234)
    assert seeded == answer(temperature=1.0, seed=1234)
    others = {answer(temperature=1.0, seed=s) for s in (1, 2, 3)}
    assert len(others | {seeded}) > 1, "different seeds never changed the answer"
    assert answer(temperature=1.0, seed=-1) == answer(temperature=1.0, seed=2**64 - 1)  # the same 64 bits


def test_n_choices_are_rows(client, model_id):
    completion = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=12, n=3,
                                                temperature=1.0, seed=5)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.usage.completion_tokens == 36
    again = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=12, n=3, temperature=1.0, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in completion.choices]


# -- streaming -------------------------------------------------------------------------------------


def test_stream_joins_to_the_plain_answer_with_usage(client, model_id):
    plain = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=30)
    stream = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done(client, server):
    with httpx.stream("POST", f"{server.url}/chat/completions",
                      json={"messages": CHAT, "max_tokens": 5, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and "usage" not in events[0]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


WORDS = ["你好，世界", "😀🎉 party", "北京的天气"]
WORD_SCHEMA = {"type": "object", "properties": {"word": {"enum": WORDS}}, "required": ["word"],
               "additionalProperties": False}


def test_stream_keeps_chinese_and_emoji_intact(client, model_id):
    """The grammar makes the model spell multi-byte characters, one byte token at a time
    (stories260K's tokenizer has no Chinese): no chunk splits a character."""
    response_format = {"type": "json_schema", "json_schema": {"name": "word", "schema": WORD_SCHEMA}}
    plain = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=60, response_format=response_format)
    stream = list(client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=60, stream=True,
                                                 response_format=response_format))
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == plain.choices[0].message.content
    assert json.loads(plain.choices[0].message.content)["word"] in WORDS
    assert all("\ufffd" not in piece for piece in pieces)


def test_legacy_completions(client, model_id, golden, sp):
    several = client.completions.create(model=model_id, prompt=["Once upon a time", "The dog"], max_tokens=8, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text  # greedy
    assert several.usage.completion_tokens == 32
    batch = client.completions.create(model=model_id, prompt=[[1], [1]], max_tokens=20)
    assert [c.text for c in batch.choices] == [sp.decode(golden["generated_ids"][:20])] * 2
    echo = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=5, echo=True)
    assert echo.choices[0].text.startswith("Once upon a time")
    stream = list(client.completions.create(model=model_id, prompt=[1], max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in stream) == batch.choices[0].text


# -- logprobs --------------------------------------------------------------------------------------


def test_logprobs_shape_and_values(client, model_id, stories_hf):
    """Chat logprobs in OpenAI's shape; the values are mlx-lm's log-softmax of the same prompt."""
    import mlx.core as mx
    from mlx_lm import load as mlx_lm_load

    from mlx_tfm.tokenizer import load_tokenizer

    completion = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=6, logprobs=True,
                                                top_logprobs=3)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == 6
    for entry in entries:
        assert bytes(entry.bytes).decode("utf-8", errors="backslashreplace") == entry.token
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy
    assert "".join(e.token for e in entries).strip() == completion.choices[0].message.content.strip()

    reference_model, _ = mlx_lm_load(str(stories_hf))
    ids = load_tokenizer(stories_hf).apply_chat_template(CHAT, add_generation_prompt=True)
    logits = reference_model(mx.array([ids]))[0, -1]
    reference = np.array(logits - mx.logsumexp(logits))
    best = np.argsort(-reference)[:3]
    assert [t.logprob for t in entries[0].top_logprobs] == pytest.approx(reference[best].tolist(), abs=1e-4)

    legacy = client.completions.create(model=model_id, prompt=[1], max_tokens=4, logprobs=2)
    logprobs = legacy.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0


# -- structured output -----------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "likes": {"type": "array", "items": {"enum": ["cats", "dogs"]}, "maxItems": 2}},
          "required": ["name", "age", "likes"], "additionalProperties": False}


def test_json_schema_output_validates(client, model_id):
    for n in (1, 2):
        completion = client.chat.completions.create(
            model=model_id, messages=CHAT, max_tokens=120, n=n, temperature=0.8, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        for choice in completion.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    free = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=20)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)  # the story model does not write JSON by itself


def test_json_object_output_is_an_object(client, model_id):
    """The story model rambles inside JSON strings, so it may be cut by max_tokens; what it
    wrote is still an object's beginning, and a finished one parses."""
    completion = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=60,
                                                response_format={"type": "json_object"})
    choice = completion.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def test_tools_need_a_template_that_renders_them(client, model_id):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=CHAT, tools=tools)
    assert caught.value.body["param"] == "tools"


def test_a_bad_schema_is_a_400(server):
    body = {"messages": CHAT, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}
    response = httpx.post(f"{server.url}/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


# -- bad input ---------------------------------------------------------------------------------------------


BAD_FIELDS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 129}, "n"),  # past the spec's bound of 128 (the server once stopped at 8)
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
]


@pytest.mark.parametrize("change, param", BAD_FIELDS, ids=[p for _, p in BAD_FIELDS])
def test_invalid_fields_are_400_naming_the_field(server, change, param):
    response = httpx.post(f"{server.url}/chat/completions", json={"messages": CHAT, **change})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0] in error["message"] and "\n" not in error["message"]


def test_invalid_fields_through_the_openai_client(client, model_id):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=CHAT, temperature=-1)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "temperature"


def test_malformed_json_is_400(server):
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = httpx.post(f"{server.url}/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, body
        assert response.json()["error"]["code"] == "invalid_json"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert caught.value.body["code"] == "model_not_found"
    response = httpx.get(f"{client.base_url}models/gpt-4o")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_unknown_path_and_method(server):
    response = httpx.get(f"{server.root}/v1/engines")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.get(f"{server.url}/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_prompt_longer_than_the_context_is_400(client, model_id, server):
    long_story = "Once upon a time there was a cat. " * 120  # > 512 tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": long_story}])
    assert caught.value.body["code"] == "context_length_exceeded"
    response = httpx.post(f"{server.url}/completions", json={"prompt": [1] * 600})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    response = httpx.post(f"{server.url}/completions", json={"prompt": [1, 100000]})
    assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]


def test_body_over_the_limit_is_413(server):
    huge = json.dumps({"messages": CHAT, "padding": "x" * (9 << 20)}).encode()
    response = httpx.post(f"{server.url}/chat/completions", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no content-length: counted as it arrives
        yield b'{"messages": [], "padding": "'
        for _ in range(10):
            yield b"x" * (1 << 20)
        yield b'"}'

    response = httpx.post(f"{server.url}/chat/completions", content=chunked())
    assert response.status_code == 413


# -- concurrency and the prompt cache -------------------------------------------------------------------------


def test_eight_concurrent_requests_equal_their_sequential_outputs(client, model_id, server):
    prompts = [f"Tell me about {thing}." for thing in ("a cat", "a dog", "the sun", "a tree", "a boat", "rain",
                                                          "a big red ball", "Lily and Ben")]
    sequential = [client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": p}],
                                                  max_tokens=40).choices[0].message.content for p in prompts]

    async def together():
        async_client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        async with async_client:
            answers = await asyncio.gather(*[
                async_client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": p}],
                                                     max_tokens=40) for p in prompts])
        return [a.choices[0].message.content for a in answers]

    assert asyncio.run(together()) == sequential
    assert len(set(sequential)) > 1


def test_streamed_n_choices_join_to_the_plain_ones(client, model_id):
    kwargs = dict(model=model_id, messages=CHAT, max_tokens=16, n=3, temperature=1.0, seed=9)
    plain = client.chat.completions.create(**kwargs)
    joined = ["", "", ""]
    finished = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            joined[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert joined == [c.message.content for c in plain.choices] and sorted(finished) == [0, 1, 2]


def test_mixed_load_never_mixes_answers(server, model_id):
    """24 clients at once, each sending a few requests: streamed and not, some leaving
    early, some malformed. Every valid answer equals its prompt's answer alone."""
    prompts = [f"Tell me about {thing}." for thing in ("a cat", "a dog", "the moon", "a red car", "a fish", "Ben")]
    expected = {}
    for prompt in prompts:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24}
        expected[prompt] = httpx.post(f"{server.url}/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    async def worker(http: httpx.AsyncClient, number: int) -> list[str]:
        problems = []
        for step in range(4):
            kind = (number + step) % 4
            prompt = prompts[(number * 7 + step) % len(prompts)]
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "stream": kind == 1}
            if kind == 3:
                response = await http.post(f"{server.url}/chat/completions", content=b'{"messages": [')
                problems += [] if response.status_code == 400 else [f"malformed -> {response.status_code}"]
            elif kind == 2:  # leaves after the first event
                async with http.stream("POST", f"{server.url}/chat/completions", json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        break
            elif kind == 1:
                text = ""
                async with http.stream("POST", f"{server.url}/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            text += chunk["choices"][0]["delta"].get("content", "") if chunk["choices"] else ""
                problems += [] if text == expected[prompt] else [f"stream {prompt!r}: {text!r}"]
            else:
                answer = (await http.post(f"{server.url}/chat/completions", json=body)).json()
                text = answer["choices"][0]["message"]["content"]
                problems += [] if text == expected[prompt] else [f"plain {prompt!r}: {text!r}"]
        return problems

    async def everyone():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*[worker(http, n) for n in range(24)])

    problems = [p for worker_problems in asyncio.run(everyone()) for p in worker_problems]
    assert not problems, problems[:5]
    assert httpx.get(f"{server.root}/health").status_code == 200
    deadline = time.monotonic() + 10
    while metric_value(server, "mlx_tfm_requests_running") + metric_value(server, "mlx_tfm_requests_waiting") > 0:
        assert time.monotonic() < deadline, "rows were left running after every client was gone"
        time.sleep(0.05)


def test_a_short_request_finishes_while_a_long_one_streams(client, model_id, server):
    arrivals = []

    def long_stream():
        with httpx.stream("POST", f"{server.url}/completions", timeout=60,
                          json={"prompt": [1], "max_tokens": 400, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(("long", time.monotonic()))

    thread = threading.Thread(target=long_stream)
    thread.start()
    while len(arrivals) < 3:
        time.sleep(0.005)
    short = client.completions.create(model=model_id, prompt="The dog", max_tokens=4)
    short_done = time.monotonic()
    thread.join()
    assert short.choices[0].finish_reason == "length"
    later = [t for name, t in arrivals if t > short_done]
    assert len(later) > 10, "the long stream did not go on after the short request was answered"


def test_second_turn_reuses_the_cache_and_answers_as_a_cold_run(client, model_id, stories_hf):
    from mlx_tfm import generate
    from mlx_tfm import load

    first_turn = [{"role": "system", "content": "You tell short stories about animals and friends."},
                  {"role": "user", "content": "Tell me a story about a fox."}]
    first = client.chat.completions.create(model=model_id, messages=first_turn, max_tokens=30)
    second_turn = first_turn + [{"role": "assistant", "content": first.choices[0].message.content},
                                {"role": "user", "content": "And then what happened?"}]
    second = client.chat.completions.create(model=model_id, messages=second_turn, max_tokens=30)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens

    model, tokenizer = load(stories_hf)  # cold: a fresh cache, no batching
    ids = tokenizer.apply_chat_template(second_turn, add_generation_prompt=True)
    assert second.choices[0].message.content == generate(model, tokenizer, ids, max_tokens=30)
    other = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=30)
    assert other.choices[0].message.content == generate(
        model, tokenizer, tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]), max_tokens=30)


# -- lifecycle -------------------------------------------------------------------------------------------------


def metric_value(server, name: str) -> float:
    text = httpx.get(f"{server.root}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_client_that_leaves_after_two_chunks(client, model_id, server):
    cancelled_before = metric_value(server, 'mlx_tfm_engine_requests_total{finish_reason="cancelled"}')
    with httpx.stream("POST", f"{server.url}/completions",
                      json={"prompt": [1], "max_tokens": 400, "stream": True}) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip((l for l in lines if l.startswith("data: ")), range(2))]
    assert len(received) == 2
    deadline = time.monotonic() + 10
    while metric_value(server, 'mlx_tfm_engine_requests_total{finish_reason="cancelled"}') <= cancelled_before:
        assert time.monotonic() < deadline, "the row of the client that left was never cancelled"
        time.sleep(0.05)
    assert metric_value(server, "mlx_tfm_requests_running") == 0
    assert httpx.get(f"{server.root}/health").status_code == 200
    after = client.completions.create(model=model_id, prompt=[1], max_tokens=5)
    assert after.choices[0].finish_reason == "length"


def test_a_client_that_leaves_before_a_plain_answer(server):
    """The client hangs up once its row is running (seen on /metrics), not after a guessed
    time: on a fast machine the whole answer can come back before any fixed timeout."""
    cancelled_before = metric_value(server, 'mlx_tfm_engine_requests_total{finish_reason="cancelled"}')
    address = httpx.URL(server.root)
    body = json.dumps({"prompt": [1], "max_tokens": 450}).encode()
    with socket.create_connection((address.host, address.port), timeout=10) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (address.host.encode(), len(body), body))
        deadline = time.monotonic() + 10
        while metric_value(server, "mlx_tfm_requests_running") < 1:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.002)
    deadline = time.monotonic() + 10
    while metric_value(server, 'mlx_tfm_engine_requests_total{finish_reason="cancelled"}') <= cancelled_before:
        assert time.monotonic() < deadline, "the row of the client that left was never cancelled"
        time.sleep(0.05)
    assert httpx.get(f"{server.root}/health").status_code == 200


def test_metrics_are_prometheus_text(server):
    httpx.post(f"{server.url}/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    httpx.post(f"{server.url}/chat/completions", json={"messages": []})
    response = httpx.get(f"{server.root}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("mlx_tfm_http_requests_total", "mlx_tfm_prompt_tokens_total", "mlx_tfm_generation_tokens_total",
                 "mlx_tfm_generation_tokens_per_second", "mlx_tfm_requests_running", "mlx_tfm_requests_waiting",
                 "mlx_tfm_prompt_cache_hits_total", "mlx_tfm_prompt_cache_bytes"):
        assert f"# TYPE {name} " in text, name
    assert 'mlx_tfm_http_requests_total{path="/v1/chat/completions",status="200"}' in text
    assert 'status="400"' in text
    assert metric_value(server, "mlx_tfm_generation_tokens_total") > 0


def test_health(server):
    response = httpx.get(f"{server.root}/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"
