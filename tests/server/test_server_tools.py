"""`mlx-tfm server` on a tiny random model whose chat template renders tools and
thinking (Qwen 2.5 / Hermes format, built in tests/fixtures/server_models.py): tool calls
forced by tool_choice (the grammar makes the random model call the tool), parsed into
message.tool_calls and streamed as deltas; the tool result rendered back (counted against
transformers' rendering of the same template); thinking in reasoning_content; an internal
error as a one-line 500 with the traceback in the server log."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from fixtures.server_models import tool_model_folder
from fixtures.server_process import served

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "北京"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return tool_model_folder(tmp_path_factory.mktemp("server-tools"))


@pytest.fixture(scope="module")
def server(model_folder):
    yield from served("--model", str(model_folder), "--max-tokens", "24", "--log-level", "warning")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference_tokenizer(model_folder):
    """transformers' own rendering of the template (the reference for prompt sizes)."""
    return PreTrainedTokenizerFast.from_pretrained(str(model_folder))


def reference_length(tokenizer, messages, **kwargs) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_forced_tool_call_round_trip(client, reference_tokenizer):
    first = client.chat.completions.create(model="tool-model", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice=named("get_weather"), max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert first.usage.prompt_tokens == reference_length(reference_tokenizer, ASK, tools=[WEATHER, TIME])

    result = {"temperature": 21, "sky": "sunny"}
    conversation = ASK + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    second = client.chat.completions.create(model="tool-model", messages=conversation, tools=[WEATHER, TIME],
                                            max_tokens=10)
    assert second.choices[0].finish_reason in ("length", "stop")
    reference = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}]},
        {"role": "tool", "content": json.dumps(result)}]
    rendered = reference_tokenizer.apply_chat_template(reference, tools=[WEATHER, TIME], add_generation_prompt=True,
                                                       tokenize=False)
    assert '"temperature": 21' in rendered and "<tool_response>" in rendered
    assert second.usage.prompt_tokens == reference_length(reference_tokenizer, reference, tools=[WEATHER, TIME])
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prompt


def test_required_tool_choice_picks_one_of_the_tools(client):
    completion = client.chat.completions.create(model="tool-model", messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice="required", max_tokens=80, n=2, temperature=1.0, seed=11)
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_call_deltas(client):
    plain = client.chat.completions.create(model="tool-model", messages=ASK, tools=[WEATHER],
                                           tool_choice=named("get_weather"), max_tokens=80)
    chunks = list(client.chat.completions.create(model="tool-model", messages=ASK, tools=[WEATHER],
                                                 tool_choice=named("get_weather"), max_tokens=80, stream=True))
    deltas = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert deltas and {d.index for d in deltas} == {0}
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == plain.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tool_choice_none_and_auto(client):
    none = client.chat.completions.create(model="tool-model", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=5)
    plain = client.chat.completions.create(model="tool-model", messages=ASK, max_tokens=5)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # tools left out of the prompt
    auto = client.chat.completions.create(model="tool-model", messages=ASK, tools=[WEATHER], max_tokens=5)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens


def test_thinking_goes_to_reasoning_content(client, server):
    thinking = client.chat.completions.create(model="tool-model", messages=ASK, max_tokens=12,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = thinking.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not message.content  # the random model never closes </think>
    answer = client.chat.completions.create(model="tool-model", messages=ASK, max_tokens=12)
    assert "reasoning_content" not in answer.choices[0].message.model_extra and answer.choices[0].message.content

    with httpx.stream("POST", f"{server.url}/chat/completions", json={
            "messages": ASK, "max_tokens": 12, "stream": True,
            "chat_template_kwargs": {"enable_thinking": True}}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events if e["choices"])
    assert streamed == reasoning


def test_template_kwargs_may_not_replace_the_servers_variables(server):
    response = httpx.post(f"{server.url}/chat/completions",
                          json={"messages": ASK, "chat_template_kwargs": {"messages": []}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


def logged(server, text: str, timeout: float = 10) -> bool:
    """Whether ``text`` reaches the server's log (read by a thread of the test: it may lag
    behind the answer)."""
    deadline = time.monotonic() + timeout
    while text not in server.log and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in server.log


def test_internal_error_is_a_one_line_500_with_the_traceback_logged(client, server):
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="tool-model", messages=ASK,
                                       extra_body={"chat_template_kwargs": {"fail_with": 1}})
    error = caught.value.body
    assert caught.value.status_code == 500 and error["type"] == "server_error" and "\n" not in error["message"]
    assert "ZeroDivisionError" not in error["message"]
    assert logged(server, "ZeroDivisionError") and "Traceback" in server.log
    assert client.chat.completions.create(model="tool-model", messages=ASK, max_tokens=3).choices[0].message.content
