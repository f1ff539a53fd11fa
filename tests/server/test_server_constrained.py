"""Structured output on a model whose vocabulary is larger than its tokenizer's (as most
real models: their embedding rows are rounded up), through `mlx-tfm server` and the
openai client; and internal failures (a handler's, a logits processor's inside the
engine) as OpenAI-shaped 500 bodies that never carry the exception's text, while the
engine's own messages (a UserError) still do."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from fixtures.server_models import tool_model_folder
from fixtures.openai_spec import spec_checking_http_client
from fixtures.server_process import served

ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
FORECAST = {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "北京"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": FORECAST}}
SECRET = "secret detail of /internal/path"


@pytest.fixture(scope="module")
def padded_folder(tmp_path_factory):
    """The tool model with 512 embedding rows for its 406 tokens (llguidance's mask has 416 bits)."""
    folder = tool_model_folder(tmp_path_factory.mktemp("padded"), vocab_multiple=128)
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tokens = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert rows > -(-tokens // 32) * 32, "the model must have more rows than the grammar's mask has bits"
    return folder


@pytest.fixture(scope="module")
def server(padded_folder):
    yield from served("--model", str(padded_folder), "--max-tokens", "48", "--log-level", "warning")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, http_client=spec_checking_http_client())


def test_json_schema_holds_on_a_vocabulary_larger_than_the_tokenizers(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
    answer = client.chat.completions.create(model="tool-model", messages=ASK, max_tokens=48,
                                            response_format=response_format)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), FORECAST)


def test_a_forced_tool_call_holds_on_a_vocabulary_larger_than_the_tokenizers(client):
    answer = client.chat.completions.create(model="tool-model", messages=ASK, tools=[WEATHER], max_tokens=48,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), FORECAST)


# -- internal failures, in process (Starlette's test client over the app) -------------------------


@pytest.fixture(scope="module")
def app_client(padded_folder):
    from starlette.testclient import TestClient

    from mlx_tfm.server.app import ServerState, build_app
    from mlx_tfm.server.settings import ServerSettings

    state = ServerState(ServerSettings(model=str(padded_folder), max_tokens=8))
    with TestClient(build_app(state), raise_server_exceptions=False) as test_client:
        assert state.loaded.wait(60) and state.load_error is None, state.load_error
        yield test_client


def assert_generic_500(body: dict) -> None:
    """OpenAI's error shape, a one-line message that tells nothing of the exception."""
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["type"] == "server_error" and isinstance(error["message"], str) and error["message"]
    assert "\n" not in error["message"] and SECRET not in json.dumps(body), body
    assert "RuntimeError" not in error["message"], body


def raise_secret(*args, **kwargs):
    raise RuntimeError(SECRET)


def test_a_handler_that_raises_is_a_generic_500(app_client, monkeypatch):
    from mlx_tfm.server import app

    monkeypatch.setattr(app, "chat_completions", raise_secret)
    response = app_client.post("/v1/chat/completions", json={"messages": ASK})
    assert response.status_code == 500
    assert_generic_500(response.json())


JSON_OBJECT = {"messages": ASK, "response_format": {"type": "json_object"}}


def test_a_logits_processor_that_raises_is_a_generic_500(app_client, monkeypatch):
    """The engine fails the row with the exception's text; the client sees none of it."""
    from mlx_tfm.server.constrained import GrammarProcessor

    monkeypatch.setattr(GrammarProcessor, "__call__", raise_secret)
    response = app_client.post("/v1/chat/completions", json=JSON_OBJECT)
    assert response.status_code == 500
    assert_generic_500(response.json())


def test_a_stream_whose_processor_raises_ends_with_a_generic_error_event(app_client, monkeypatch):
    from mlx_tfm.server.constrained import GrammarProcessor

    monkeypatch.setattr(GrammarProcessor, "__call__", raise_secret)
    with app_client.stream("POST", "/v1/chat/completions", json={**JSON_OBJECT, "stream": True}) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert_generic_500(json.loads(events[-1]))


def test_the_engines_own_words_still_reach_the_client(app_client, monkeypatch):
    """A UserError is meant for the client (as the refusal of constrained output on a
    model split over ranks): its message is the 500's, as it is."""
    from mlx_tfm.errors import UserError
    from mlx_tfm.server.constrained import GrammarProcessor

    def refuse(*args, **kwargs):
        raise UserError("constrained output is refused here")

    monkeypatch.setattr(GrammarProcessor, "__call__", refuse)
    response = app_client.post("/v1/chat/completions", json=JSON_OBJECT)
    assert response.status_code == 500 and response.json()["error"]["message"] == "constrained output is refused here"


def test_the_server_answers_after_the_failures(app_client):
    body = app_client.post("/v1/chat/completions", json={**JSON_OBJECT, "max_tokens": 4}).json()
    assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
