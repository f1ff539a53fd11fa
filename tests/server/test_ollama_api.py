"""Ollama's API (mlx_tfm/server/ollama_api.py), driven by the official ``ollama`` client
and by httpx for raw NDJSON and error bodies.

On the scripted server (tests/fixtures/scripted_server.py: the real app, template,
tokenizer, grammars and parsers over an engine that plays a fixed answer): chat and
generate, streamed and not; the prompt equal to transformers' rendering of the same
conversation; options reaching the engine's sampler; format as "json" and as a schema
(held by the grammar); thinking; a tool call round trip; tags, show, ps, version, pull;
errors in Ollama's shape. On stories260K (`mlx-tfm server`): greedy text equal to the
OpenAI endpoint's, num_predict counted. On a sentence-transformers model: /api/embed and
/api/embeddings equal to sentence-transformers' encode."""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from fixtures.encoder_models import bert_with_tokenizer, sentence_transformer_folder
from fixtures.scripted_server import ScriptedServer, scripted_tokenizer_folder
from fixtures.server_models import TOOL_CHAT_TEMPLATE
from fixtures.server_process import served
from mlx_tfm.server.settings import ServerSettings

MODEL = "scripted-model"
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted_folder(tmp_path_factory):
    return scripted_tokenizer_folder(tmp_path_factory.mktemp("ollama-scripted"), [])


@pytest.fixture(scope="module")
def scripted(scripted_folder):
    server = ScriptedServer(scripted_folder)
    server.tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    server.requests = []
    submit = server.engine.submit

    def recording_submit(request, on_event):  # the engine requests, for their sampling settings
        server.requests.append(request)
        return submit(request, on_event)

    server.engine.submit = recording_submit
    yield server
    server.close()


@pytest.fixture(scope="module")
def root(scripted):
    return scripted.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(root):
    return ollama.Client(host=root, timeout=30)


@pytest.fixture(scope="module")
def reference(scripted_folder):
    """transformers' rendering of the tool template (the folder's tokenizer_config holds it)."""
    return PreTrainedTokenizerFast.from_pretrained(str(scripted_folder))


def reference_ids(reference, messages, **kwargs) -> list[int]:
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return reference(text, add_special_tokens=False)["input_ids"]


def ndjson_lines(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


# -- chat and generate ----------------------------------------------------------------------------


def test_chat_answers_in_ollamas_shape(scripted, client, reference):
    scripted.engine.script = ["Hello", " world"]
    response = client.chat(MODEL, messages=ASK)
    assert response.message.role == "assistant" and response.message.content == "Hello world"
    assert response.done and response.done_reason == "stop" and response.model == MODEL
    assert scripted.engine.prompts[-1] == reference_ids(reference, ASK)
    assert response.prompt_eval_count == len(scripted.engine.prompts[-1]) and response.eval_count == 2
    assert response.total_duration >= response.eval_duration >= 0 and response.created_at.endswith("Z")


def test_chat_streams_ndjson_by_default(scripted, client, root):
    scripted.engine.script = ["Once", " upon", " a time"]
    chunks = list(client.chat(MODEL, messages=ASK, stream=True))
    assert "".join(c.message.content for c in chunks) == "Once upon a time"
    assert [c.done for c in chunks] == [False] * 3 + [True] and chunks[-1].eval_count == 3
    # Ollama streams unless "stream": false is sent
    with httpx.stream("POST", f"{root}/api/chat", json={"model": MODEL, "messages": ASK}) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = ndjson_lines(response)
    assert len(lines) == 4 and lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_a_model_named_with_its_latest_tag_is_the_served_one(scripted, client):
    scripted.engine.script = ["Hi"]
    assert client.chat(f"{MODEL}:latest", messages=ASK).message.content == "Hi"


def test_generate_renders_the_prompt_as_a_user_turn(scripted, client, reference):
    scripted.engine.script = ["Sunny", "."]
    response = client.generate(MODEL, prompt=ASK[0]["content"], system="Be brief.")
    assert response.response == "Sunny." and response.done and response.done_reason == "stop"
    assert scripted.engine.prompts[-1] == reference_ids(reference, [{"role": "system", "content": "Be brief."}, *ASK])
    chunks = list(client.generate(MODEL, prompt=ASK[0]["content"], stream=True))
    assert "".join(c.response for c in chunks) == "Sunny." and chunks[-1].done


def test_raw_generate_takes_the_prompt_as_it_is(scripted, client, reference):
    scripted.engine.script = ["x"]
    client.generate(MODEL, prompt="<|im_start|>user\nhi", raw=True)
    assert scripted.engine.prompts[-1] == reference("<|im_start|>user\nhi")["input_ids"]


def test_an_empty_prompt_loads_the_model(scripted, client):
    before = len(scripted.engine.prompts)
    assert client.generate(MODEL).done_reason == "load"
    assert client.chat(MODEL, messages=[]).done_reason == "load"
    assert client.generate(MODEL, keep_alive=0).done_reason == "unload"
    assert len(scripted.engine.prompts) == before  # nothing ran


def test_options_reach_the_sampler(scripted, client):
    scripted.engine.script = ["ok"]
    options = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 11, "num_predict": 17,
               "stop": ["\n\n", "END"], "repeat_penalty": 1.3, "repeat_last_n": 32, "num_ctx": 4096}
    client.chat(MODEL, messages=ASK, options=options, keep_alive="5m")
    request = scripted.requests[-1]
    sampling = request.sampling
    assert (sampling.temp, sampling.top_p, sampling.top_k, sampling.min_p, sampling.seed) == (0.7, 0.9, 40, 0.05, 11)
    assert (sampling.repetition_penalty, sampling.repetition_context_size) == (1.3, 32)
    assert request.max_tokens == 17 and request.stop_strings == ("\n\n", "END")
    client.generate(MODEL, prompt="hi", options={"num_predict": -1})  # endless: the server's --max-tokens
    assert scripted.requests[-1].max_tokens == ServerSettings(model=MODEL).max_tokens


def test_format_holds_the_answer_to_a_schema(scripted, client):
    """The grammar writes the answer (the scripted engine answers it with random logits)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    answer = client.chat(MODEL, messages=ASK, format=schema, options={"num_predict": 200}).message.content
    jsonschema.validate(json.loads(answer), schema)
    text = client.generate(MODEL, prompt="Some JSON, please.", format="json", options={"num_predict": 200}).response
    assert isinstance(json.loads(text), (dict, list))


def test_think_opens_the_reasoning(scripted, client, reference):
    scripted.engine.script = ["Adding.", "\n</think>\n\n", "4"]
    message = client.chat(MODEL, messages=ASK, think=True).message
    assert message.thinking == "Adding." and message.content == "4"
    assert scripted.engine.prompts[-1] == reference_ids(reference, ASK, enable_thinking=True)
    chunks = list(client.chat(MODEL, messages=ASK, think=True, stream=True))
    assert "".join(c.message.thinking or "" for c in chunks) == "Adding."
    assert "".join(c.message.content for c in chunks) == "4"


def test_tool_call_round_trip(scripted, client, reference):
    scripted.engine.script = [CALL[:20], CALL[20:]]
    message = client.chat(MODEL, messages=ASK, tools=[WEATHER]).message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris", "days": 3}
    assert not message.content
    streamed = [c.message.tool_calls for c in client.chat(MODEL, messages=ASK, tools=[WEATHER], stream=True)
                if c.message.tool_calls]
    assert [[c.function.arguments for c in calls] for calls in streamed] == [[{"city": "Paris", "days": 3}]]
    # the call and its result, sent back, render as transformers renders them
    scripted.engine.script = ["Sunny for 3 days."]
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": '{"forecast": "sunny"}', "tool_name": "get_weather"}]
    assert client.chat(MODEL, messages=history, tools=[WEATHER]).message.content == "Sunny for 3 days."
    openai_history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": '{"forecast": "sunny"}', "name": "get_weather"}]
    # (the client sends the tool as its Tool model holds it: without the bounds)
    sent_tool = ollama.Tool.model_validate(WEATHER).model_dump(exclude_none=True)
    assert scripted.engine.prompts[-1] == reference_ids(reference, openai_history, tools=[sent_tool])


# -- the model's endpoints ----------------------------------------------------------------------------


def test_tags_show_ps_version(scripted, client, root):
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.details.format == "safetensors"
    shown = client.show(MODEL)
    assert shown.template == TOOL_CHAT_TEMPLATE and "tools" in shown.capabilities
    assert "thinking" in shown.capabilities and "completion" in shown.capabilities
    (loaded,) = client.ps().models
    assert loaded.model == MODEL
    assert httpx.get(f"{root}/api/version").json()["version"].count(".") == 2
    assert httpx.get(f"{root}/").text == "Ollama is running" and httpx.head(f"{root}/").status_code == 200


def test_pull_is_offline(client):
    assert client.pull(MODEL).status == "success"  # the served model is there
    with pytest.raises(ollama.ResponseError) as error:
        client.pull("llama3.2")
    assert error.value.status_code == 404 and "downloads nothing" in error.value.error


# -- errors --------------------------------------------------------------------------------------------


def one_line_error(response: httpx.Response, status: int) -> str:
    body = response.json()
    assert response.status_code == status and list(body) == ["error"], body
    assert "\n" not in body["error"] and "Traceback" not in body["error"]
    return body["error"]


@pytest.mark.parametrize("body, status, words", [
    (b'{"model": "scripted-model", "messages": [', 400, "not valid JSON"),
    (b'{"model": "scripted-model", "messages": "hello"}', 400, "messages"),
    (b'{"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}], '
     b'"options": {"temperature": "hot"}}', 400, "temperature"),
    (b'{"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}], "format": "yaml"}', 400,
     "format"),
    (b'{"model": "scripted-model", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}', 400,
     "images"),
    (b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}', 404, "does not exist"),
])
def test_bad_chat_bodies_get_ollamas_error(root, body, status, words):
    assert words in one_line_error(httpx.post(f"{root}/api/chat", content=body), status)


def test_errors_reach_the_client(client):
    with pytest.raises(ollama.ResponseError) as error:
        client.generate(MODEL, prompt="hi", suffix="tail")
    assert error.value.status_code == 400 and "suffix" in error.value.error
    with pytest.raises(ollama.ResponseError) as error:
        client.embed(MODEL, input="hi")  # a decoder does not embed
    assert error.value.status_code == 400 and "encoder" in error.value.error


# -- real models -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories(stories_hf):
    yield from served("--model", str(stories_hf), "--max-tokens", "32", "--log-level", "warning")


def test_greedy_generate_equals_the_openai_endpoints(stories, stories_hf):
    """The same engine behind both APIs: raw generate == a legacy completion, greedy."""
    prompt = "Once upon a time"
    expected = openai.OpenAI(base_url=stories.url, api_key="unused", max_retries=0).completions.create(
        model=stories_hf.name, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    client = ollama.Client(host=stories.root, timeout=60)
    response = client.generate(stories_hf.name, prompt=prompt, raw=True, options={"num_predict": 12,
                                                                                   "temperature": 0})
    assert response.response == expected and response.done_reason == "length" and response.eval_count == 12
    streamed = client.generate(stories_hf.name, prompt=prompt, raw=True, stream=True,
                               options={"num_predict": 12, "temperature": 0})
    assert "".join(c.response for c in streamed) == expected


def test_logprobs_equal_the_openai_endpoints(stories, stories_hf):
    """Ollama's logprobs are OpenAI's chat entries (tested against mlx-lm in test_server.py)."""
    chat = [{"role": "user", "content": "Tell me a story about a cat."}]
    expected = openai.OpenAI(base_url=stories.url, api_key="unused", max_retries=0).chat.completions.create(
        model=stories_hf.name, messages=chat, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3).choices[0].logprobs.content
    client = ollama.Client(host=stories.root, timeout=60)
    options = {"num_predict": 6, "temperature": 0}
    answer = client.chat(stories_hf.name, messages=chat, logprobs=True, top_logprobs=3, options=options)
    streamed = [entry for chunk in client.chat(stories_hf.name, messages=chat, logprobs=True, top_logprobs=3,
                                               options=options, stream=True) for entry in chunk.logprobs or []]
    for entries in (answer.logprobs, streamed):
        assert [e.token for e in entries] == [e.token for e in expected]
        assert np.allclose([e.logprob for e in entries], [e.logprob for e in expected], atol=1e-5)
        assert [[t.token for t in e.top_logprobs] for e in entries] == \
            [[t.token for t in e.top_logprobs] for e in expected]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama-embed")
    bert_with_tokenizer(root / "bert")
    model = sentence_transformer_folder(root / "st", root / "bert", "mean", 16, True)
    for server in served("--model", str(root / "st"), "--log-level", "warning"):
        yield server, model


def test_embed_equals_sentence_transformers(embedder):
    server, model = embedder
    texts = ["the cat sat on the mat", "the sea is blue"]
    client = ollama.Client(host=server.root, timeout=60)
    result = client.embed("st", input=texts)
    assert np.abs(np.array(result.embeddings) - model.encode(texts)).max() < 1e-5 and result.prompt_eval_count > 0
    legacy = client.embeddings("st", prompt=texts[1])
    assert np.abs(np.array(legacy.embedding) - model.encode(texts[1:])[0]).max() < 1e-5
    assert "embedding" in client.show("st").capabilities
    with pytest.raises(ollama.ResponseError) as error:
        client.chat("st", messages=ASK)
    assert error.value.status_code == 400 and "encoder" in error.value.error
