"""`mlx-tfm server` on a tiny random model whose chat template renders tools and
thinking (Qwen 2.5 / Hermes format, built in tests/fixtures/server_models.py): tool calls
forced by tool_choice (the grammar makes the random model call the tool), parsed into
message.tool_calls and streamed as deltas; the tool result rendered back (counted against
transformers' rendering of the same template); thinking in reasoning_content; an internal
error as a one-line 500 with the traceback in the server log.

Then each family's tool call format (tool_formats.py) on a scripted server
(tests/fixtures/scripted_server.py: the real app over an engine that answers with the text
a family's model writes): calls and reasoning parsed, streamed with stable indexes and
ids, rendered back as transformers renders them; forced calls held to the schema by each
format's grammar; the --tool-call-parser / --reasoning-parser flags; enable_thinking."""

from __future__ import annotations

import json
import random
import re
import time

import httpx
import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from fixtures.scripted_server import FAMILY_SPECIAL_MARKERS, ScriptedServer, scripted_tokenizer_folder
from fixtures.server_models import TOOL_CHAT_TEMPLATE, tool_model_folder
from fixtures.openai_spec import spec_checking_http_client
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
    # every JSON answer is checked against OpenAI's spec on the way (fixtures/openai_spec.py)
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, http_client=spec_checking_http_client())


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


# -- each family's format, through the openai client, on a scripted answer -------------------------
# The server (tests/fixtures/scripted_server.py) answers with the text a family's model
# writes, streamed in random small pieces, the markers its tokenizer keeps as special
# tokens as ids without text; templates written like the families' own, in short.

SKELETON = """{%- if tools %}<|im_start|>system
@NOTE@
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}@CALLS@<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}@GENERATION@{% endif %}"""

LOOP = "{%- for call in message.tool_calls or [] %}@CALL@{%- endfor %}"
ARGS = "{%- for key, value in call.function.arguments.items() %}@ARG@{%- endfor %}"


def family_template(note: str, call: str, arg: str = "", around: tuple[str, str] = ("", ""),
                    generation: str = "<|im_start|>assistant\n") -> str:
    calls = "{%- if message.tool_calls %}" + around[0] + LOOP.replace("@CALL@", call) + around[1] + "{%- endif %}"
    calls = calls.replace("@ARGS@", ARGS.replace("@ARG@", arg))
    return SKELETON.replace("@NOTE@", note).replace("@CALLS@", calls).replace("@GENERATION@", generation)


NAME, JSON_ARGS = "{{ call.function.name }}", "{{ call.function.arguments | tojson }}"
OPEN, CLOSE = "{{ '{' }}", "{{ '}' }}"  # Gemma's braces, next to Jinja's
FAMILIES = {
    "hermes": family_template("Call tools in <tool_call></tool_call> tags.",
                              '\n<tool_call>\n{"name": "' + NAME + '", "arguments": ' + JSON_ARGS + "}\n</tool_call>"),
    "qwen3_coder": family_template("Call as <tool_call>\n<function=example_function_name>",
                                   "\n<tool_call>\n<function=" + NAME + ">\n@ARGS@</function>\n</tool_call>",
                                   "<parameter={{ key }}>\n{{ value }}\n</parameter>\n"),
    "llama3_json": family_template("<|start_header_id|>Respond with a JSON for a function call.",
                                   '<|python_tag|>{"name": "' + NAME + '", "parameters": ' + JSON_ARGS + "}"),
    "pythonic": family_template("Write [func_name1(params_name1=params_value1), func_name2(params)]",
                                "[" + NAME + "(@ARGS@)]", "{{ key }}={{ value | tojson }}, "),
    "mistral": family_template("[AVAILABLE_TOOLS]", "[TOOL_CALLS]" + NAME + "[ARGS]" + JSON_ARGS),
    "gemma4": family_template("Call as <|tool_call>call:name{...}<tool_call|>",
                              "<|tool_call>call:" + NAME + OPEN + "@ARGS@" + CLOSE + "<tool_call|>", '{{ key }}:<|"|>{{ value }}<|"|>,'),
    "function_gemma": family_template("<start_function_call>call:name{}<end_function_call>",
                                      "<start_function_call>call:" + NAME + OPEN + "@ARGS@" + CLOSE + "<end_function_call>",
                                      "{{ key }}:<escape>{{ value }}<escape>,"),
    "glm45": family_template("Call as <tool_call>{name}<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>",
                             "<tool_call>" + NAME + "\n@ARGS@</tool_call>",
                             "<arg_key>{{ key }}</arg_key>\n<arg_value>{{ value }}</arg_value>\n"),
    "kimi_k2": family_template("Tools:", "<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>" + JSON_ARGS
                               + "<|tool_call_end|>", around=("<|tool_calls_section_begin|>",
                                                              "<|tool_calls_section_end|>")),
    "harmony": family_template("namespace functions", "<|start|>assistant<|channel|>commentary to=functions." + NAME
                               + " <|constrain|>json<|message|>" + JSON_ARGS + "<|call|>", generation="<|start|>assistant"),
    "deepseek_v31": family_template("Tools:", "<｜tool▁call▁begin｜>" + NAME + "<｜tool▁sep｜>" + JSON_ARGS
                                    + "<｜tool▁call▁end｜>", around=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
    "minimax_m2": family_template("<minimax:tool_call> XML", '<invoke name="' + NAME + '">\n@ARGS@</invoke>\n',
                                  '<parameter name="{{ key }}">{{ value }}</parameter>\n',
                                  around=("<minimax:tool_call>\n", "</minimax:tool_call>")),
}

SPECIAL_MARKERS = FAMILY_SPECIAL_MARKERS

PARIS, UTC = ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
NOTE_123 = ("take_note", {"text": "123"})  # typed by the schema: a string, though it reads as a number
FAMILY_TOOLS = [WEATHER, TIME, NOTE]
# family -> (the answer its model writes, content, reasoning, calls)
ANSWERS = {
    "hermes": ('<think>\nsunny?\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>', "Let me look.", "sunny?", [PARIS]),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=take_note>\n<parameter=text>\n123\n"
                    "</parameter>\n</function>\n</tool_call>", None, None, [PARIS, NOTE_123]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, None,
                    [PARIS]),
    "pythonic": ('[get_weather(city="Paris", days=3), get_time(zone="UTC")]', None, None, [PARIS, UTC]),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
                None, None, [PARIS, UTC]),
    "gemma4": ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>', None, None, [PARIS]),
    "function_gemma": ("Checking. <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}"
                       "<end_function_call>", "Checking.", None, [PARIS]),
    "glm45": ("<think>Paris, 3 days.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
              "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", None, "Paris, 3 days.",
              [PARIS]),
    "kimi_k2": ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
                '<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|><|tool_calls_section_end|>', None, None,
                [PARIS, UTC]),
    "harmony": ('<|channel|>analysis<|message|>The user wants Paris.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', None,
                "The user wants Paris.", [PARIS]),
    "deepseek_v31": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, None, [PARIS]),
    "minimax_m2": ('<think>easy</think>\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="take_note">\n'
                   '<parameter name="text">123</parameter>\n</invoke>\n</minimax:tool_call>', None, "easy",
                   [PARIS, NOTE_123]),
}


@pytest.fixture(scope="module")
def scripted_folder(tmp_path_factory):
    return scripted_tokenizer_folder(tmp_path_factory.mktemp("scripted"), SPECIAL_MARKERS)


@pytest.fixture(scope="module")
def scripted(scripted_folder):
    server = ScriptedServer(scripted_folder)
    yield server
    server.close()


@pytest.fixture(scope="module")
def scripted_client(scripted):
    return openai.OpenAI(base_url=scripted.url, api_key="unused", max_retries=0,
                         http_client=spec_checking_http_client(timeout=30))


def script_of(answer: str, tokenizer, rng: random.Random) -> list[str | int]:
    """The answer as a model streams it: special markers as their ids, text in pieces of 1-4 characters."""
    pattern = "(" + "|".join(re.escape(m) for m in SPECIAL_MARKERS) + ")"
    script = []
    for part in re.split(pattern, answer):
        if part in SPECIAL_MARKERS:
            script.append(tokenizer.encode(part, add_special_tokens=False)[0])
        while part and part not in SPECIAL_MARKERS:
            size = rng.randint(1, 4)
            script.append(part[:size])
            part = part[size:]
    return script


def ask(scripted, family: str, seed: int):
    scripted.tokenizer.chat_template = FAMILIES[family]
    scripted.engine.script = script_of(ANSWERS[family][0], scripted.tokenizer, random.Random(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_tool_calls_and_reasoning(scripted, scripted_client, family):
    _, content, reasoning, calls = ANSWERS[family]
    ask(scripted, family, seed=1)
    message = scripted_client.chat.completions.create(model="scripted-model", messages=ASK, tools=FAMILY_TOOLS)
    choice = message.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert choice.message.model_extra.get("reasoning_content") == reasoning
    got = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)
    if family == "kimi_k2":  # the model's own ids, as its template writes them back
        assert [c.id for c in got] == ["functions.get_weather:0", "functions.get_time:1"]

    ask(scripted, family, seed=2)
    chunks = list(scripted_client.chat.completions.create(model="scripted-model", messages=ASK, tools=FAMILY_TOOLS,
                                                          stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (content or "")
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    streamed = [call for d in deltas for call in d.tool_calls or []]
    by_index = {i: [call for call in streamed if call.index == i] for i in sorted({c.index for c in streamed})}
    assert list(by_index) == list(range(len(calls)))
    for i, parts in by_index.items():
        assert parts[0].id and parts[0].function.name == calls[i][0] and all(p.id in (None, parts[0].id) for p in parts)
        assert json.loads("".join(p.function.arguments or "" for p in parts)) == calls[i][1]
    assert [d for d in (c.choices[0].finish_reason for c in chunks if c.choices) if d] == ["tool_calls"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_calls_go_back_into_its_template(scripted, scripted_client, scripted_folder, family):
    """The parsed calls and a tool's result, sent back, render as transformers renders
    the conversation with the calls the answer meant."""
    ask(scripted, family, seed=3)
    first = scripted_client.chat.completions.create(model="scripted-model", messages=ASK, tools=FAMILY_TOOLS)
    message = first.choices[0].message
    results = [{"role": "tool", "tool_call_id": c.id, "content": "21 C"} for c in message.tool_calls]
    scripted.engine.script = ["Sunny."]
    answer = scripted_client.chat.completions.create(model="scripted-model", tools=FAMILY_TOOLS,
                                                     messages=ASK + [message.model_dump(exclude_none=True)] + results)
    assert answer.choices[0].message.content == "Sunny." and answer.choices[0].message.tool_calls is None

    _, content, _, calls = ANSWERS[family]
    meant = [{"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
             for i, (name, arguments) in enumerate(calls)]
    reference = PreTrainedTokenizerFast(tokenizer_file=str(scripted_folder / "tokenizer.json"))
    conversation = ASK + [{"role": "assistant", "content": content or "", "tool_calls": meant}] + [
        {"role": "tool", "content": "21 C"} for _ in calls]
    text = reference.apply_chat_template(conversation, tools=FAMILY_TOOLS, chat_template=FAMILIES[family],
                                         add_generation_prompt=True, tokenize=False)
    assert scripted.engine.prompts[-1] == reference(text, add_special_tokens=False)["input_ids"]


def test_a_flag_chooses_the_format_and_reasoning_over_the_template(scripted_folder):
    server = ScriptedServer(scripted_folder, tool_call_parser="pythonic", reasoning_parser="none")
    try:
        server.tokenizer.chat_template = FAMILIES["hermes"]
        server.engine.script = ["<think>x</think>", '[get_time(zone="UTC")]']
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
        message = client.chat.completions.create(model="scripted-model", messages=ASK, tools=[TIME]).choices[0].message
        assert message.content == '<think>x</think>[get_time(zone="UTC")]' and message.tool_calls is None
        server.engine.script = ['[get_time(zone="UTC")]']
        (call,) = client.chat.completions.create(model="scripted-model", messages=ASK, tools=[TIME]).choices[0] \
            .message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == UTC
    finally:
        server.close()


def test_enable_thinking_reaches_the_template(scripted, scripted_client, reference_tokenizer):
    """vLLM's and mlx-lm's top-level ``enable_thinking`` is the template's variable (a
    chat_template_kwargs value still wins); a prompt that opens <think> starts the answer in it."""
    scripted.tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    scripted.engine.script = ["Adding.", "\n</think>\n\n", "4"]
    message = scripted_client.chat.completions.create(model="scripted-model", messages=ASK,
                                                      extra_body={"enable_thinking": True}).choices[0].message
    assert message.content == "4" and message.model_extra["reasoning_content"] == "Adding."
    thinking = reference_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False,
                                                       enable_thinking=True)
    assert thinking.endswith("<think>\n") and scripted.engine.prompts[-1] == reference_tokenizer(
        thinking, add_special_tokens=False)["input_ids"]
    scripted.engine.script = ["4"]
    message = scripted_client.chat.completions.create(model="scripted-model", messages=ASK, extra_body={
        "enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content == "4" and "reasoning_content" not in message.model_extra
    assert not reference_tokenizer.decode(scripted.engine.prompts[-1]).endswith("<think>\n")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_forced_call_holds_to_the_schema(scripted, scripted_client, family):
    """tool_choice names a tool: the grammar of the family's format (its special-token
    markers named by id) makes random logits a call that parses, valid by the schema."""
    scripted.tokenizer.chat_template = FAMILIES[family]
    answer = scripted_client.chat.completions.create(model="scripted-model", messages=ASK, tools=FAMILY_TOOLS,
                                                     tool_choice=named("get_weather"), max_tokens=200)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    spelled = scripted.tokenizer.decode(scripted.engine.generated[-1])  # (special tokens left out)
    assert not [marker for marker in SPECIAL_MARKERS if marker in spelled], "a special marker spelled as text"


def test_harmony_channels_without_tools(scripted, scripted_client):
    """gpt-oss's template names harmony: its analysis channel is reasoning_content and its
    final channel the content, tools offered or not (the markers are special tokens)."""
    scripted.tokenizer.chat_template = FAMILIES["harmony"]
    answer = "<|channel|>analysis<|message|>2 and 2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    scripted.engine.script = script_of(answer, scripted.tokenizer, random.Random(4))
    message = scripted_client.chat.completions.create(model="scripted-model", messages=ASK).choices[0].message
    assert message.content == "It is 4." and message.model_extra["reasoning_content"] == "2 and 2."


def test_a_forced_call_after_a_prompt_that_opens_thinking_is_a_call(scripted, scripted_client):
    """The grammar writes the call from the first token: it is not taken for reasoning."""
    scripted.tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    answer = scripted_client.chat.completions.create(
        model="scripted-model", messages=ASK, tools=[WEATHER], tool_choice=named("get_weather"), max_tokens=200,
        extra_body={"enable_thinking": True})
    message = answer.choices[0].message
    assert "reasoning_content" not in message.model_extra and message.tool_calls[0].function.name == "get_weather"


def test_reasoning_effort_reaches_the_template(scripted, scripted_client):
    """OpenAI's reasoning_effort is the variable gpt-oss's template reads ("Reasoning: high")."""
    scripted.tokenizer.chat_template = "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}" \
                                       "<|end|>" + FAMILIES["harmony"]
    scripted.engine.script = ["<|channel|>final<|message|>ok"]
    for effort in ("high", None):
        scripted_client.chat.completions.create(model="scripted-model", messages=ASK,
                                                **({"reasoning_effort": effort} if effort else {}))
        prompt = scripted.tokenizer.decode(scripted.engine.prompts[-1])
        assert f"Reasoning: {effort or 'medium'}" in prompt
