"""Anthropic's Messages API (mlx_tfm/server/anthropic_api.py), driven by the official
``anthropic`` client (max_retries=0) and by httpx for raw typed events and error bodies.

On the scripted server (tests/fixtures/scripted_server.py: the real app, template,
tokenizer, grammars and parsers over an engine that plays a fixed answer): messages with
the prompt equal to transformers' rendering of the same conversation; the typed stream of
events; thinking blocks; a tool_use round trip (tool_result rendered back), forced calls
held to the input_schema; count_tokens; errors in Anthropic's shape. On stories260K
(`mlx-tfm server`): greedy text equal to the OpenAI endpoint's, max_tokens and
stop_sequences as stop reasons."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from fixtures.scripted_server import ScriptedServer, scripted_tokenizer_folder
from fixtures.server_models import TOOL_CHAT_TEMPLATE
from fixtures.server_process import served

MODEL = "scripted-model"
QUESTION = "What's the weather in Paris for the next 3 days?"
ASK = [{"role": "user", "content": QUESTION}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather forecast of a city.", "input_schema": SCHEMA}
OPENAI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                   "parameters": SCHEMA}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted_folder(tmp_path_factory):
    return scripted_tokenizer_folder(tmp_path_factory.mktemp("anthropic-scripted"), [])


@pytest.fixture(scope="module")
def scripted(scripted_folder):
    server = ScriptedServer(scripted_folder)
    server.tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    yield server
    server.close()


@pytest.fixture(scope="module")
def root(scripted):
    return scripted.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(root):
    return anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference(scripted_folder):
    """transformers' rendering of the tool template (the folder's tokenizer_config holds it)."""
    return PreTrainedTokenizerFast.from_pretrained(str(scripted_folder))


def reference_ids(reference, messages, **kwargs) -> list[int]:
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return reference(text, add_special_tokens=False)["input_ids"]


def typed_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a stream."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


# -- messages --------------------------------------------------------------------------------------


def test_message_in_anthropics_shape(scripted, client, reference):
    scripted.engine.script = ["Hello", " world"]
    message = client.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=ASK)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello world")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None and message.model == MODEL
    expected = reference_ids(reference, [{"role": "system", "content": "Be brief."}, *ASK])
    assert scripted.engine.prompts[-1] == expected
    assert (message.usage.input_tokens, message.usage.output_tokens) == (len(expected), 2)
    # system as text blocks, content as blocks: the same prompt
    client.messages.create(model=MODEL, max_tokens=64, system=[{"type": "text", "text": "Be brief."}],
                           messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert scripted.engine.prompts[-1] == expected


def test_stream_of_typed_events(scripted, client, root):
    scripted.engine.script = ["Once", " upon", " a time"]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ASK) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Once upon a time" and final.content[0].text == "Once upon a time"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3
    body = {"model": MODEL, "max_tokens": 64, "messages": ASK, "stream": True}
    with httpx.stream("POST", f"{root}/v1/messages", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = typed_events(response)
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                                            "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == len(scripted.engine.prompts[-1])
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_thinking_blocks(scripted, client, reference):
    scripted.engine.script = ["Adding.", "\n</think>\n\n", "4"]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, thinking=thinking)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Adding." and message.content[1].text == "4"
    assert scripted.engine.prompts[-1] == reference_ids(reference, ASK, enable_thinking=True)
    events = list(client.messages.create(model=MODEL, max_tokens=64, messages=ASK, thinking=thinking, stream=True))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "Adding."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "4"
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1]


def test_tool_use_round_trip(scripted, client, reference):
    scripted.engine.script = ["Let me check.", CALL[:20], CALL[20:]]
    message = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER])
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["text", "tool_use"]
    use = message.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3} and use.id.startswith("toolu_")
    # the call and its result, sent back, render as transformers renders them
    scripted.engine.script = ["Sunny."]
    history = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": '{"forecast": "sunny"}'}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=64, messages=history, tools=[WEATHER])
    assert answer.content[0].text == "Sunny." and answer.stop_reason == "end_turn"
    openai_history = [*ASK, {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "name": "get_weather", "content": '{"forecast": "sunny"}'}]
    assert scripted.engine.prompts[-1] == reference_ids(reference, openai_history, tools=[OPENAI_WEATHER])


def test_streamed_tool_use(scripted, client):
    scripted.engine.script = [CALL[:30], CALL[30:]]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris", "days": 3}
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_follows_the_schema(scripted, client, tool_choice):
    """The grammar writes the call (the scripted engine answers it with random logits)."""
    message = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER],
                                     tool_choice=tool_choice)
    use = message.content[-1]
    assert message.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMA)


def test_output_config_holds_the_answer_to_a_schema(scripted, client):
    """Structured outputs: the grammar writes the answer (random logits on the scripted engine)."""
    message = client.messages.create(model=MODEL, max_tokens=200, messages=ASK,
                                     output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), SCHEMA)


def test_count_tokens(scripted, client, reference):
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK, tools=[WEATHER])
    expected = reference_ids(reference, [{"role": "system", "content": "Be brief."}, *ASK], tools=[OPENAI_WEATHER])
    assert counted.input_tokens == len(expected)


# -- errors ----------------------------------------------------------------------------------------------


def one_line_error(response: httpx.Response, status: int, kind: str) -> str:
    body = response.json()
    assert response.status_code == status and body["type"] == "error" and body["error"]["type"] == kind, body
    assert "\n" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("body, words", [
    (b'{"model": "scripted-model", "max_tokens": 8, "messages": [', "not valid JSON"),
    (b'{"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}', "max_tokens"),
    (b'{"model": "scripted-model", "max_tokens": 8, "messages": "hi"}', "messages"),
    (b'{"model": "scripted-model", "max_tokens": "many", "messages": [{"role": "user", "content": "hi"}]}',
     "max_tokens"),
    (b'{"model": "scripted-model", "max_tokens": 8, "temperature": 1.5, '
     b'"messages": [{"role": "user", "content": "hi"}]}', "temperature"),
    (b'{"model": "scripted-model", "max_tokens": 8, "messages": [{"role": "user", "content": '
     b'[{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]}', "image"),
])
def test_bad_bodies_get_anthropics_error(root, body, words):
    assert words in one_line_error(httpx.post(f"{root}/v1/messages", content=body), 400, "invalid_request_error")


def test_errors_reach_the_client(client, root):
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=ASK)
    assert error.value.body["error"]["type"] == "not_found_error" and MODEL in error.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_time"})
    assert "get_time" in error.value.body["error"]["message"]
    assert "messages" in one_line_error(httpx.post(f"{root}/v1/messages/count_tokens", json={"model": MODEL}), 400,
                                        "invalid_request_error")


# -- a real model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories(stories_hf):
    yield from served("--model", str(stories_hf), "--max-tokens", "32", "--log-level", "warning")


def test_stop_reasons_on_a_real_model(stories, stories_hf):
    """Greedy text equal to the OpenAI endpoint's; max_tokens and a stop sequence end it."""
    chat = [{"role": "user", "content": "Tell me a story about a cat."}]
    expected = openai.OpenAI(base_url=stories.url, api_key="unused", max_retries=0).chat.completions.create(
        model=stories_hf.name, messages=chat, max_tokens=16, temperature=0).choices[0].message.content
    client = anthropic.Anthropic(base_url=stories.root, api_key="unused", max_retries=0, timeout=60)
    greedy = {"temperature": 0}  # (this client has no temperature argument: sent as Anthropic's API takes it)
    message = client.messages.create(model=stories_hf.name, max_tokens=16, extra_body=greedy, messages=chat)
    assert message.content[0].text == expected and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 16
    word = expected.split()[3]
    stopped = client.messages.create(model=stories_hf.name, max_tokens=16, extra_body=greedy, messages=chat,
                                     stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == expected[:expected.index(word)]
