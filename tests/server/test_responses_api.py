"""OpenAI's Responses API (mlx_tfm/server/responses_api.py), driven by the official
``openai`` client (``client.responses.create`` / ``.stream``, max_retries=0) and by httpx
for raw typed events and error bodies; every response object and stream event is checked
against the published OpenAPI document (tests/fixtures/responses_spec.py).

On the scripted server (tests/fixtures/scripted_server.py: the real app, template,
tokenizer, grammars and parsers over an engine that plays a fixed answer): prompts equal
to transformers' rendering of the same conversation (input items, instructions,
previous_response_id); typed events; reasoning items; function calls and their outputs;
forced calls and text.format held to a schema; the store (GET, DELETE, unknown ids, its
bound); OpenAI-shaped 400s. On stories260K (`mlx-tfm server`): greedy text equal to the
chat endpoint's, max_output_tokens as an incomplete response."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from fixtures.responses_spec import check_event, check_item_list, check_response, nullable_as_any_of
from fixtures.scripted_server import ScriptedServer, scripted_tokenizer_folder
from fixtures.server_models import TOOL_CHAT_TEMPLATE
from fixtures.server_process import served
from mlx_tfm.server.errors import APIError
from mlx_tfm.server.responses_api import ResponsesRequest, ResponseStore, Turn, error_event

MODEL = "scripted-model"
QUESTION = "What's the weather in Paris for the next 3 days?"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast of a city.",
           "parameters": SCHEMA, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": SCHEMA}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted_folder(tmp_path_factory):
    return scripted_tokenizer_folder(tmp_path_factory.mktemp("responses-scripted"), [])


@pytest.fixture(scope="module")
def scripted(scripted_folder):
    server = ScriptedServer(scripted_folder)
    server.tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(scripted):
    return openai.OpenAI(base_url=scripted.url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def reference(scripted_folder):
    """transformers' rendering of the tool template (the folder's tokenizer_config holds it)."""
    return PreTrainedTokenizerFast.from_pretrained(str(scripted_folder))


def reference_ids(reference, messages, **kwargs) -> list[int]:
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return reference(text, add_special_tokens=False)["input_ids"]


def post(scripted, **body) -> dict:
    """A raw response object, checked against the spec."""
    response = httpx.post(f"{scripted.url}/responses", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 200, response.text
    check_response(response.json())
    return response.json()


def streamed(scripted, model: str = MODEL, **body) -> list[dict]:
    """The stream's events (each checked against the spec; the event line names its type)."""
    events, name = [], None
    with httpx.stream("POST", f"{scripted.url}/responses", json={"model": model, "stream": True, **body},
                      timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name
                check_event(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_the_spec_loader_reads_nullable_as_a_null_branch():
    """OpenAPI 3.0's nullable, as JSON Schema 2020-12 reads it (SOURCES.md), at any depth."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "nullable": True}}}
    assert nullable_as_any_of(schema) == {"type": "object", "properties": {
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}


# -- responses --------------------------------------------------------------------------------------


def test_text_response(scripted, client, reference):
    scripted.engine.script = ["Hello", " world"]
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                       metadata={"run": "1"}, temperature=0.5, max_output_tokens=64)
    assert response.output_text == "Hello world" and response.status == "completed"
    assert response.id.startswith("resp_") and response.metadata == {"run": "1"} and response.temperature == 0.5
    expected = reference_ids(reference, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": QUESTION}])
    assert scripted.engine.prompts[-1] == expected
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (len(expected), 2, len(expected) + 2)
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    body = post(scripted, input=QUESTION, instructions="Be brief.")
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["output"][0]["content"][0] == {"type": "output_text", "text": "Hello world", "annotations": [],
                                               "logprobs": []}


def test_input_items_render_as_the_chat_conversation(scripted, reference):
    scripted.engine.script = ["Fine."]
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                             {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "How are you?"}]
    post(scripted, input=items)
    # a developer message is the templates' system message (as on the chat endpoint)
    expected = reference_ids(reference, [{"role": "system", "content": "Answer in one word."},
                                         {"role": "user", "content": "Hi\nthere"},
                                         {"role": "assistant", "content": "Hello."},
                                         {"role": "user", "content": "How are you?"}])
    assert scripted.engine.prompts[-1] == expected


def test_stream_of_typed_events(scripted, client):
    scripted.engine.script = ["Once", " upon", " a time"]
    events = streamed(scripted, input=QUESTION)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 3, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Once upon a time"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Once upon a time"
    assert final["usage"]["output_tokens"] == 3
    assert httpx.get(f"{scripted.url}/responses/{final['id']}").json() == final  # stored as it was sent
    with client.responses.stream(model=MODEL, input=QUESTION) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert stream.get_final_response().output_text == "".join(texts) == "Once upon a time"


def test_reasoning_item(scripted, client, reference):
    scripted.engine.script = ["Adding.", "\n</think>\n\n", "4"]
    response = client.responses.create(model=MODEL, input=QUESTION, reasoning={"effort": "low"})
    assert scripted.engine.prompts[-1] == reference_ids(reference, [{"role": "user", "content": QUESTION}],
                                                        enable_thinking=True)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Adding." and response.output_text == "4"
    # the tokens before the answer began: the reasoning and its closing tag
    assert response.usage.output_tokens_details.reasoning_tokens == 2
    events = streamed(scripted, input=QUESTION, reasoning={"effort": "low"})
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Adding."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "4"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]


def test_function_call_round_trip(scripted, client, reference):
    scripted.engine.script = ["Let me check.", CALL[:20], CALL[20:]]
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER])
    check_response(first.model_dump(mode="json", exclude_unset=True))
    assert [item.type for item in first.output] == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": call.call_id, "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
               {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": '{"forecast": "sunny"}'}]
    expected = reference_ids(reference, history, tools=[CHAT_WEATHER])
    scripted.engine.script = ["Sunny."]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny"}'}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER])
    assert chained.output_text == "Sunny." and chained.previous_response_id == first.id
    assert scripted.engine.prompts[-1] == expected
    # the same conversation sent whole, as a client that keeps its own state does
    items = [{"role": "user", "content": QUESTION}, *[item.model_dump() for item in first.output], result]
    client.responses.create(model=MODEL, input=items, tools=[WEATHER], store=False)
    assert scripted.engine.prompts[-1] == expected


def test_previous_response_carries_the_conversation_not_the_instructions(scripted, client, reference):
    """The earlier turns (a reasoning item among them) come back; the instructions do not (as OpenAI's spec says)."""
    scripted.engine.script = ["Adding.", "\n</think>\n\n", "4"]
    first = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", reasoning={"effort": "low"})
    scripted.engine.script = ["5"]
    second = client.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=first.id)
    assert second.output_text == "5" and second.instructions is None
    expected = reference_ids(reference, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "4"},
                                         {"role": "user", "content": "And tomorrow?"}])
    assert scripted.engine.prompts[-1] == expected


def test_streamed_function_call(scripted):
    scripted.engine.script = [CALL[:30], CALL[30:]]
    events = streamed(scripted, input=QUESTION, tools=[WEATHER])
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0]["name"] == "get_weather"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(deltas) == json.loads(done[0]["arguments"]) == {"city": "Paris", "days": 3}
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["function_call"] and final[0]["status"] == "completed"


def test_parallel_tool_calls_off_keeps_one_call(scripted, client):
    second = CALL.replace("Paris", "London").replace("3", "1")
    scripted.engine.script = [CALL, "\n", second]
    both = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER])
    assert [json.loads(item.arguments)["city"] for item in both.output] == ["Paris", "London"]
    one = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], parallel_tool_calls=False)
    assert [json.loads(item.arguments)["city"] for item in one.output] == ["Paris"]
    assert one.parallel_tool_calls is False


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_call_follows_the_schema(scripted, tool_choice):
    """The grammar writes the call (the scripted engine answers it with random logits)."""
    body = post(scripted, input=QUESTION, tools=[WEATHER], tool_choice=tool_choice, max_output_tokens=200)
    call = body["output"][-1]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMA)
    assert body["tool_choice"] == tool_choice


def test_text_format_holds_the_answer_to_a_schema(scripted, client):
    form = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    body = post(scripted, input=QUESTION, text={"format": form}, max_output_tokens=200)
    assert body["text"]["format"]["name"] == "forecast"
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), SCHEMA)
    answer = client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "json_object"}},
                                     max_output_tokens=200)
    assert isinstance(json.loads(answer.output_text), dict)


# -- the store ------------------------------------------------------------------------------------------


def test_stored_responses(scripted, client):
    scripted.engine.script = ["Kept."]
    kept = client.responses.create(model=MODEL, input=QUESTION)
    assert client.responses.retrieve(kept.id).output_text == "Kept."
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve(kept.id)
    assert kept.id in error.value.body["message"]
    unkept = client.responses.create(model=MODEL, input=QUESTION, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, input="And then?", previous_response_id=unkept.id)
    assert error.value.body["param"] == "previous_response_id" and unkept.id in error.value.body["message"]


ITEMS = [{"type": "message", "id": "msg_given", "role": "developer", "content": "Answer in one word."},
         {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                         {"type": "input_text", "text": "there"}]},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"type": "function_call_output", "call_id": "call_1", "output": '{"forecast": "sunny"}'},
         {"role": "user", "content": "And tomorrow?"}]


def listed_items(scripted, response_id: str, **query) -> dict:
    """A raw page of input items, checked against the spec's ResponseItemList."""
    page = httpx.get(f"{scripted.url}/responses/{response_id}/input_items", params=query, timeout=30)
    assert page.status_code == 200, page.text
    check_item_list(page.json())
    return page.json()


def test_input_items_are_listed_in_pages(scripted, client):
    scripted.engine.script = ["Sunny."]
    response = client.responses.create(model=MODEL, input=ITEMS, tools=[WEATHER])
    newest_first = listed_items(scripted, response.id)
    assert [item["type"] for item in newest_first["data"]] == [item.get("type", "message") for item in ITEMS[::-1]]
    assert newest_first["has_more"] is False and newest_first["last_id"] == "msg_given"  # a given id is kept
    items = list(client.responses.input_items.list(response.id, order="asc", limit=2))  # three pages, followed
    assert [item.id for item in items] == [item["id"] for item in newest_first["data"][::-1]]
    assert items[1].content[0].text == "Hi" and items[1].content[1].text == "there" and items[1].role == "user"
    assert items[2].content[0].text == "Hello." and items[3].arguments == ITEMS[3]["arguments"]
    assert items[4].output == ITEMS[4]["output"] and items[5].content[0].text == "And tomorrow?"
    page = listed_items(scripted, response.id, order="asc", limit=2, after=items[1].id)
    assert [item["id"] for item in page["data"]] == [items[2].id, items[3].id] and page["has_more"] is True
    assert page["first_id"] == items[2].id and page["last_id"] == items[3].id
    chained = client.responses.create(model=MODEL, input="Thanks!", previous_response_id=response.id)
    assert [item.content[0].text for item in client.responses.input_items.list(chained.id)] == ["Thanks!"]


@pytest.mark.parametrize("query, param, words", [
    ({"limit": 0}, "limit", "limit must be an integer from 1 to 100"),
    ({"limit": 101}, "limit", "limit must be an integer from 1 to 100"),
    ({"order": "newest"}, "order", "order must be 'asc' or 'desc'"),
    ({"after": "msg_unknown"}, "after", "no input item with id 'msg_unknown'"),
])
def test_bad_input_item_queries_are_400s(scripted, client, query, param, words):
    scripted.engine.script = ["Ok."]
    response = client.responses.create(model=MODEL, input=QUESTION)
    answer = httpx.get(f"{scripted.url}/responses/{response.id}/input_items", params=query, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert words in answer.json()["error"]["message"]


def test_a_forgotten_responses_input_items_are_404(scripted, client):
    scripted.engine.script = ["Ok."]
    response = client.responses.create(model=MODEL, input=QUESTION)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.input_items.list(response.id)
    assert error.value.body["code"] == "response_not_found" and response.id in error.value.body["message"]


def test_a_reasoning_summary_carries_the_thinking(scripted, client):
    """reasoning.summary asked: the thinking is the reasoning item's summary (there is no other summarizer)."""
    scripted.engine.script = ["Adding.", "\n</think>\n\n", "4"]
    asked = {"effort": "low", "summary": "auto"}
    response = client.responses.create(model=MODEL, input=QUESTION, reasoning=asked)
    check_response(response.model_dump(mode="json", exclude_unset=True))
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and [part.text for part in reasoning.summary] == ["Adding."]
    assert not reasoning.content and response.output_text == "4" and response.reasoning.summary == "auto"
    events = streamed(scripted, input=QUESTION, reasoning=asked)
    assert [e["type"] for e in events if "reasoning" in e["type"]] == [
        "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
    assert [e["summary_index"] for e in events if "reasoning" in e["type"]] == [0] * 4
    assert events[-1]["response"]["output"][0]["summary"] == [{"type": "summary_text", "text": "Adding."}]
    with client.responses.stream(model=MODEL, input=QUESTION, reasoning=asked) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_summary_text.delta"]
        assert "".join(deltas) == "Adding." and stream.get_final_response().output_text == "4"


def test_the_store_keeps_the_last_responses():
    store = ResponseStore(capacity=2)
    store.put({"id": "a"}, [])
    store.put({"id": "b"}, [])
    store.get("a")  # used: kept over "b", the least recently used
    store.put({"id": "c"}, [])
    assert set(store.entries) == {"a", "c"}
    with pytest.raises(APIError) as error:
        store.get("b")
    assert error.value.status == 404 and "'b'" in error.value.message


# -- errors ----------------------------------------------------------------------------------------------


def test_a_failure_in_the_stream_is_the_specs_error_event():
    turn = Turn(ResponsesRequest(input="hi"), MODEL, ResponseStore(), [])
    turn.items.event("response.created", response=turn.response())
    frame = error_event(turn, APIError(500, "the generation failed", code="generation_failed")).decode()
    name, data = frame.split("\n")[:2]
    event = json.loads(data.removeprefix("data: "))
    check_event(event)
    assert name == "event: error" and event["sequence_number"] == 1 and event["message"] == "the generation failed"


def one_line_error(response: httpx.Response, status: int) -> dict:
    body = response.json()["error"]
    assert response.status_code == status and body["type"] == "invalid_request_error", body
    assert "\n" not in body["message"] and "Traceback" not in body["message"]
    return body


@pytest.mark.parametrize("body, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input_image"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "web_search_call"),
    ({"input": []}, "input is empty"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "get_time"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "role"),
])
def test_bad_bodies_get_openais_400(scripted, body, words):
    error = one_line_error(httpx.post(f"{scripted.url}/responses", json={"model": MODEL, **body}), 400)
    assert words in error["message"], error


def test_unknown_model_and_bad_json(scripted, client):
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model="gpt-5", input="hi")
    assert MODEL in error.value.body["message"]
    broken = httpx.post(f"{scripted.url}/responses", content=b'{"model": "scripted-model", "input": [')
    assert "not valid JSON" in one_line_error(broken, 400)["message"]


# -- a real model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories(stories_hf):
    yield from served("--model", str(stories_hf), "--max-tokens", "32", "--log-level", "warning")


def test_greedy_text_and_incomplete_on_a_real_model(stories, stories_hf):
    """Greedy text equal to the chat endpoint's; max_output_tokens ends it as incomplete."""
    client = openai.OpenAI(base_url=stories.url, api_key="unused", max_retries=0, timeout=60)
    chat = [{"role": "user", "content": "Tell me a story about a cat."}]
    expected = client.chat.completions.create(model=stories_hf.name, messages=chat, max_tokens=16,
                                              temperature=0).choices[0].message.content
    response = client.responses.create(model=stories_hf.name, input=chat[0]["content"], max_output_tokens=16,
                                       temperature=0)
    check_response(response.model_dump(mode="json", exclude_unset=True))
    assert response.output_text == expected and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == 16
    # the same prompt again: the prompt cache holds it (the cached tokens are part of the input, never all of it)
    again = client.responses.create(model=stories_hf.name, input=chat[0]["content"], max_output_tokens=4,
                                    temperature=0)
    assert again.usage.input_tokens == response.usage.input_tokens
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    events = streamed(stories, model=stories_hf.name, input=chat[0]["content"], max_output_tokens=16, temperature=0)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == expected
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
