"""Each family's tool call format (server/tool_formats.py) and gpt-oss's harmony channels
(server/output.py) parsed from the texts the families' chat templates teach: fed whole,
char by char and in random pieces, the joined deltas are the same; parameter values of the
XML formats typed by the tool's JSON schema; the format chosen from the template's
markers; unknown --tool-call-parser / --reasoning-parser names refused in one line."""

from __future__ import annotations

import json
import random

import pytest

from mlx_tfm.errors import UserError
from mlx_tfm.server.output import (
    AnswerParser,
    Delta,
    ReasoningFormat,
    reasoning_format_named,
    reasoning_format_of,
)
from mlx_tfm.server.tool_formats import ToolFormat, tool_format_named, tool_format_of, typed_value

FORECAST = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                             "metric": {"type": "boolean"}, "where": {"type": "object"},
                                             "hours": {"type": "array"}, "ratio": {"type": "number"}}}
SCHEMAS = {"get_weather": FORECAST, "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}}}


def pieces_of(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def parse(text: str, tool_format: ToolFormat | None, starts_thinking: bool = False,
          reasoning: ReasoningFormat = ReasoningFormat.THINK, schemas: dict | None = None):
    """(content, reasoning, [(name, arguments)]): the same whole, char by char, and in 20
    random splits; ids are stable (each call's id comes once, with its name)."""
    schemas = SCHEMAS if schemas is None else schemas
    rng = random.Random(0)
    results = []
    for pieces in [[text], list(text)] + [pieces_of(text, rng) for _ in range(20)]:
        parser, answer = AnswerParser(starts_thinking, tool_format, schemas, reasoning), Delta()
        for piece in pieces:
            answer += parser.feed(piece)
        answer += parser.finish()
        assert len({call.id for call in answer.tool_calls}) == len(answer.tool_calls)
        results.append((answer.content, answer.reasoning,
                        [(c.name, json.loads(c.arguments)) for c in answer.tool_calls]))
    assert all(result == results[0] for result in results), "streaming changed the answer"
    return results[0]


PARIS = ("get_weather", {"city": "Paris", "days": 3})


def test_hermes_and_thinking():
    text = '<think>\nhmm\n</think>\n\nLooking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", ' \
           '"days": 3}}\n</tool_call>'
    assert parse(text, ToolFormat.HERMES) == ("Looking.", "hmm", [PARIS])


def test_qwen3_coder_xml_parameters_typed_by_the_schema():
    text = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n'
            '</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=where>\n{"lat": 48.9}\n</parameter>\n'
            '<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
            '<parameter=zone>\n007\n</parameter>\n</function>\n</tool_call>')
    assert parse(text, ToolFormat.QWEN3_CODER) == ("", "", [
        ("get_weather", {"city": "Paris", "days": 3, "metric": True, "where": {"lat": 48.9}, "ratio": 0.5}),
        ("get_time", {"zone": "007"})])
    assert parse("<tool_call>\n<function=f>\n</function>\n</tool_call>", ToolFormat.QWEN3_CODER) == ("", "", [("f", {})])
    assert parse("<tool_call>oops</tool_call>", ToolFormat.QWEN3_CODER) == ("<tool_call>oops</tool_call>", "", [])
    hermes_inside = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert parse(hermes_inside, ToolFormat.QWEN3_CODER) == ("", "", [("get_time", {"zone": "UTC"})])
    assert parse(hermes_inside, ToolFormat.GLM45) == ("", "", [("get_time", {"zone": "UTC"})])


def test_typed_values_follow_the_schema_and_keep_text_that_does_not_fit():
    assert typed_value("42", {"type": "string"}) == "42"
    assert typed_value("42", {"type": "integer"}) == 42 and typed_value("4.0", {"type": "integer"}) == 4
    assert typed_value("false", {"type": ["boolean", "null"]}) is False
    assert typed_value("{'a': [1, 2]}", {"type": "object"}) == {"a": [1, 2]}
    assert typed_value("many", {"type": "integer"}) == "many"
    assert typed_value("[1, 2]", None) == [1, 2] and typed_value("Paris", None) == "Paris"


def test_llama3_json_and_pythonic():
    assert parse('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', ToolFormat.LLAMA3) == (
        "", "", [PARIS])
    text = '[get_weather(city="Paris", days=3), get_time(zone="UTC", dst=true, at=None, hours=[1, 2])]'
    assert parse(text, ToolFormat.PYTHONIC) == ("", "", [PARIS, ("get_time", {"zone": "UTC", "dst": True, "at": None,
                                                                              "hours": [1, 2]})])
    assert parse("<|python_start|>[get_time()]<|python_end|>", ToolFormat.PYTHONIC) == ("", "", [("get_time", {})])
    assert parse("Sure. <|tool_call_start|>[get_time(zone='CET')]<|tool_call_end|>", ToolFormat.PYTHONIC) == (
        "Sure.", "", [("get_time", {"zone": "CET"})])
    assert parse("[1, 2] are numbers", ToolFormat.PYTHONIC) == ("[1, 2] are numbers", "", [])
    assert parse("[f(x=open('a'))]", ToolFormat.PYTHONIC) == ("[f(x=open('a'))]", "", [])  # literals only


def test_mistral_list_and_name_args_forms():
    assert parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
                 ToolFormat.MISTRAL) == ("", "", [PARIS])
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
    assert parse(text, ToolFormat.MISTRAL) == ("", "", [PARIS, ("get_time", {"zone": "UTC"})])
    assert parse('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}', ToolFormat.MISTRAL) == ("", "", [("get_time", {})])
    assert parse("[TOOL_CALLS]get_time[ARGS]{not json", ToolFormat.MISTRAL) == ("[TOOL_CALLS]get_time[ARGS]{not json",
                                                                               "", [])


def test_gemma4_and_function_gemma():
    text = '<|tool_call>call:get_weather{city:<|"|>Paris, "France"<|"|>,days:3,where:{lat:48.9},hours:[1,2]}<tool_call|>'
    assert parse(text, ToolFormat.GEMMA4) == ("", "", [
        ("get_weather", {"city": 'Paris, "France"', "days": 3, "where": {"lat": 48.9}, "hours": [1, 2]})])
    assert parse('<|tool_call>call:get_weather{where:{"lat":48.9}}<tool_call|>', ToolFormat.GEMMA4)[2] == [
        ("get_weather", {"where": {"lat": 48.9}})]  # (an object value as the grammar writes it: JSON)
    text = "Let me check. <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>"
    assert parse(text, ToolFormat.FUNCTION_GEMMA) == ("Let me check.", "", [PARIS])
    assert parse("<start_function_call>call:f{x:<escape>open}<end_function_call>", ToolFormat.FUNCTION_GEMMA)[2] == []


def test_glm45_arg_pairs():
    text = ("<think>sunny?</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time</tool_call>")
    assert parse(text, ToolFormat.GLM45) == ("", "sunny?", [PARIS, ("get_time", {})])
    assert parse('<tool_call>{"a": 1}</tool_call>', ToolFormat.GLM45)[2] == []


def test_kimi_k2_keeps_the_models_call_id():
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
            '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>')
    assert parse(text, ToolFormat.KIMI_K2) == ("", "", [PARIS, ("get_time", {})])
    parser = AnswerParser(False, ToolFormat.KIMI_K2)
    calls = parser.feed(text).tool_calls
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


def test_deepseek_v31_and_v3():
    text = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert parse(text, ToolFormat.DEEPSEEK_V31) == ("Checking.", "", [PARIS])
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
          '{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert parse(v3, ToolFormat.DEEPSEEK_V31) == ("", "", [("get_time", {"zone": "UTC"})])


def test_minimax_m2_invokes():
    text = ('<think>a plan</think>\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
            '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
            '</minimax:tool_call>')
    assert parse(text, ToolFormat.MINIMAX_M2) == ("", "a plan", [PARIS, ("get_time", {})])


def test_harmony_channels():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>')
    assert parse(text, ToolFormat.HARMONY) == ("", "Need the weather.", [PARIS])
    text = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
            "It is 4.<|return|>")
    assert parse(text, None, reasoning=ReasoningFormat.HARMONY) == ("It is 4.", "Easy.", [])
    recipient_first = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}'
    assert parse(recipient_first, ToolFormat.HARMONY) == ("", "", [("get_time", {"zone": "UTC"})])
    assert parse("Just text.", None, reasoning=ReasoningFormat.HARMONY) == ("Just text.", "", [])


def test_reasoning_none_keeps_think_tags_as_content():
    assert parse("<think>x</think>y", None, reasoning=ReasoningFormat.NONE) == ("<think>x</think>y", "", [])


TEMPLATES = {
    ToolFormat.HERMES: '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    ToolFormat.QWEN3_CODER: "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>",
    ToolFormat.LLAMA3: "<|start_header_id|>ipython<|end_header_id|>",
    ToolFormat.PYTHONIC: "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]",
    ToolFormat.MISTRAL: "[AVAILABLE_TOOLS]...[TOOL_CALLS]",
    ToolFormat.GEMMA4: "<|tool_call>call:{{ name }}{...}<tool_call|>",
    ToolFormat.FUNCTION_GEMMA: "<start_function_call>call:",
    ToolFormat.GLM45: "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>",
    ToolFormat.KIMI_K2: "<|tool_calls_section_begin|>",
    ToolFormat.HARMONY: "<|start|>assistant<|channel|>final<|message|>",
    ToolFormat.DEEPSEEK_V31: "<｜Assistant｜><｜tool▁calls▁begin｜>",
    ToolFormat.MINIMAX_M2: "<minimax:tool_call>\n<invoke name=",
}


@pytest.mark.parametrize("tool_format", list(ToolFormat), ids=lambda f: f.value)
def test_format_chosen_from_the_templates_markers(tool_format):
    assert tool_format_of(TEMPLATES[tool_format]) == tool_format
    assert tool_format_named(tool_format.value) == tool_format


def test_unknown_parser_names_are_one_line_errors():
    assert tool_format_named("glm47") == ToolFormat.GLM45 and tool_format_named("openai") == ToolFormat.HARMONY
    with pytest.raises(UserError, match="--tool-call-parser: unknown format 'qwen'; known: .*hermes") as caught:
        tool_format_named("qwen")
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match="--reasoning-parser: unknown format 'r1'; known: .*think"):
        reasoning_format_named("r1")
    assert reasoning_format_of(TEMPLATES[ToolFormat.HARMONY]) == ReasoningFormat.HARMONY
    assert reasoning_format_of(TEMPLATES[ToolFormat.HERMES]) == ReasoningFormat.THINK


@pytest.mark.parametrize("flag, name", [("--tool-call-parser", "qwen"), ("--reasoning-parser", "r1")])
def test_unknown_parser_flags_stop_the_server_in_one_line(capsys, stories_hf, flag, name):
    from mlx_tfm.cli import main

    assert main(["server", "--model", str(stories_hf), flag, name]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: unknown format {name!r}; known: ") and err.count("\n") == 1


# -- forced calls: each format's grammar writes a call its parser reads, valid by the schema ------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "London", "北京"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "note": {"type": "string", "maxLength": 12}},
    "required": ["city", "days", "note"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    """The tool model's tokenizer, the families' markers in it as special tokens, and
    llguidance's view of it."""
    from fixtures.scripted_server import FAMILY_SPECIAL_MARKERS, scripted_tokenizer_folder
    from mlx_tfm.server.constrained import grammar_tokenizer
    from mlx_tfm.tokenizer import load_tokenizer

    folder = scripted_tokenizer_folder(tmp_path_factory.mktemp("grammar"), FAMILY_SPECIAL_MARKERS)
    tokenizer = load_tokenizer(folder)
    special = {m: tokenizer.encode(m, add_special_tokens=False)[0] for m in FAMILY_SPECIAL_MARKERS}
    return tokenizer, grammar_tokenizer(tokenizer), special


def random_forced_answer(vocabulary, tool_format: ToolFormat, choice, seed: int, leave_out: str = "") -> str:
    """A random walk through the tokens the forced call's grammar allows, as text (the
    grammar told of the special markers but ``leave_out``)."""
    import numpy as np

    from mlx_tfm.server.constrained import make_processor, tool_call_grammar
    from mlx_tfm.server.protocol import ChatCompletionRequest, parse_body

    tokenizer, grammar_tok, special = vocabulary
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME], "tool_choice": choice}
    request = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    grammar = tool_call_grammar(request, tool_format, {m: t for m, t in special.items() if m != leave_out})
    matcher = make_processor(grammar_tok, grammar, tokenizer.vocab_size, "tool_choice").matcher
    texts = {token: marker.encode() for marker, token in special.items()}
    rng, written = np.random.default_rng(seed), b""
    for _ in range(600):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        token = int(rng.choice(np.flatnonzero(bits[:tokenizer.vocab_size])))
        if token in tokenizer.eos_token_ids:
            return written.decode()
        assert matcher.consume_token(token), matcher.get_error()
        written += texts.get(token) or tokenizer.token_bytes()[token]
    raise AssertionError(f"the walk did not end: {written.decode(errors='replace')!r}")


@pytest.mark.parametrize("tool_format", list(ToolFormat), ids=lambda f: f.value)
def test_a_forced_call_parses_and_holds_to_the_schema(vocabulary, tool_format):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    reasoning = ReasoningFormat.HARMONY if tool_format == ToolFormat.HARMONY else ReasoningFormat.THINK
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, choice in enumerate(["required", named, named]):
        text = random_forced_answer(vocabulary, tool_format, choice, seed)
        parser = AnswerParser(False, tool_format, schemas, reasoning)
        answer = parser.feed(text)
        answer += parser.finish()
        assert not answer.content and len(answer.tool_calls) == 1, text
        (call,) = answer.tool_calls
        assert choice == "required" or call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("leave_out, form", [("", "[TOOL_CALLS]get_weather[ARGS]{"), ("[ARGS]", "[TOOL_CALLS][{")])
def test_a_forced_mistral_call_takes_the_tokenizers_form(vocabulary, leave_out, form):
    """v11+ tokenizers (an [ARGS] token) write name[ARGS]{...}; older ones the JSON list."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    text = random_forced_answer(vocabulary, ToolFormat.MISTRAL, named, seed=5, leave_out=leave_out)
    assert text.startswith(form)
    parser = AnswerParser(False, ToolFormat.MISTRAL)
    answer = parser.feed(text)
    answer += parser.finish()  # (Mistral's calls run to the end of the answer)
    (call,) = answer.tool_calls
    assert call.name == "get_weather"
