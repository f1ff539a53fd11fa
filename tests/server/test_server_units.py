"""The server's pieces without a server: the answer parser (reasoning, the three tool
call formats; streamed char by char == whole), request validation messages, the command
line's one-line errors, and that `mlx-tfm generate` does not import the HTTP stack."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlx_tfm.errors import UserError
from mlx_tfm.server.errors import APIError
from mlx_tfm.server.output import AnswerParser, Delta, ToolFormat, prompt_opens_thinking, tool_format_of
from mlx_tfm.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from mlx_tfm.server.settings import parse_size


def parse(text: str, tool_format: ToolFormat | None = ToolFormat.HERMES, starts_thinking: bool = False):
    """(content, reasoning, [(name, arguments)]), checked to be the same whole or char by char."""
    results = []
    for pieces in ([text], list(text)):
        parser, answer = AnswerParser(starts_thinking, tool_format), Delta()
        for piece in pieces:
            answer += parser.feed(piece)
        answer += parser.finish()
        results.append((answer.content, answer.reasoning, [(c.name, json.loads(c.arguments)) for c in answer.tool_calls]))
    assert results[0] == results[1], "streaming changed the answer"
    return results[0]


def test_reasoning_is_split_from_the_answer():
    assert parse("<think>\nLet me add.\n</think>\n\n2 + 2 = 4", None) == ("2 + 2 = 4", "Let me add.", [])
    assert parse("Adding.\n</think>\nIt is 4.", None, starts_thinking=True) == ("It is 4.", "Adding.", [])
    assert parse("Still thinking", None, starts_thinking=True) == ("", "Still thinking", [])
    assert parse("I <think> not", None) == ("I <think> not", "", [])
    assert parse("  <thin", None) == ("  <thin", "", [])
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_hermes_tool_calls():
    text = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert parse(text) == ("I will look.", "", [("get_weather", {"city": "北京"}), ("get_time", {})])
    assert parse("<think>hmm</think><tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>") == (
        "", "hmm", [("f", {"a": 1})])
    assert parse("<tool_call>not json</tool_call> ok") == ("<tool_call>not json</tool_call> ok", "", [])
    assert parse("a <tool_call>{\"name\": \"f\"") == ("a <tool_call>{\"name\": \"f\"", "", [])  # cut by max_tokens
    assert parse("x < y and <tool") == ("x < y and <tool", "", [])


def test_llama3_tool_calls():
    assert parse('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', ToolFormat.LLAMA3) == (
        "", "", [("f", {"a": 1}), ("g", {})])
    assert parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', ToolFormat.LLAMA3) == ("", "", [("f", {"a": 1})])
    assert parse('{"not": "a call"}', ToolFormat.LLAMA3) == ('{"not": "a call"}', "", [])
    assert parse('{"name": "Ann", "age": 3}', ToolFormat.LLAMA3) == ('{"name": "Ann", "age": 3}', "", [])
    assert parse("The set {1, 2}", ToolFormat.LLAMA3) == ("The set {1, 2}", "", [])


def test_mistral_tool_calls():
    assert parse('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
                 ToolFormat.MISTRAL) == ("", "", [("f", {"a": 1}), ("g", {})])
    assert parse('[{"name": "f", "arguments": {"a": 1}}]', ToolFormat.MISTRAL) == ("", "", [("f", {"a": 1})])
    assert parse("[1] is a list", ToolFormat.MISTRAL) == ("[1] is a list", "", [])


def test_tool_format_from_the_template():
    assert tool_format_of("... <tool_call> ...") == ToolFormat.HERMES
    assert tool_format_of("... [TOOL_CALLS] ...") == ToolFormat.MISTRAL
    assert tool_format_of("<|start_header_id|>ipython<|end_header_id|> <|python_tag|>") == ToolFormat.LLAMA3
    assert tool_format_of("{% if tools %}...{% endif %}") == ToolFormat.HERMES


def test_tool_call_ids_are_unique():
    parser = AnswerParser(False, ToolFormat.HERMES)
    calls = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2).tool_calls
    assert len(calls) == 2 and calls[0].id != calls[1].id and calls[0].id.startswith("call_")


BAD_BODIES = [
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}', "stop"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', "tool_choice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],'
     b' "tool_choice": {"type": "function", "function": {"name": "g"}}}', "tool_choice"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}', "response_format"),
    (b'{"messages": [{"role": "user"}]}', "messages.0"),
    (b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}', "presence_penalty"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_chat_validation_names_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_body(body, ChatCompletionRequest)
    assert caught.value.status == 400 and caught.value.param == param


def test_completion_prompts():
    assert parse_body(b'{"prompt": "hi"}', CompletionRequest).prompts() == ["hi"]
    assert parse_body(b'{"prompt": [1, 2]}', CompletionRequest).prompts() == [[1, 2]]
    assert parse_body(b'{"prompt": [[1], [2, 3]]}', CompletionRequest).prompts() == [[1], [2, 3]]
    too_many = json.dumps({"prompt": ["a"] * 33}).encode()
    for body, param in ((b'{"prompt": []}', "prompt"), (b'{"prompt": [-1]}', "prompt.0"), (b"{}", "prompt"),
                        (too_many, "prompt")):
        with pytest.raises(APIError) as caught:
            parse_body(body, CompletionRequest)
        assert caught.value.param == param


def test_sizes():
    assert parse_size("1073741824") == 1 << 30
    assert parse_size("512MB") == 512_000_000 and parse_size("1GiB") == 1 << 30 and parse_size("1.5 k") == 1500
    for bad in ("lots", "-1", "12XB"):
        with pytest.raises(UserError, match="not a size"):
            parse_size(bad)


BAD_FLAGS = [
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--temp", "-1"], "--temp must be at least 0"),
    (["--top-p", "2"], "--top-p must be in 0..1"),
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--port", "70000"], "--port must be 0..65535"),
    (["--chat-template-args", "{nope"], "--chat-template-args is not valid JSON"),
    (["--chat-template-args", "[1]"], "--chat-template-args is not a JSON object"),
    (["--prompt-cache-bytes", "huge"], "not a size"),
    (["--api-key-file", "/nonexistent/key"], "cannot read --api-key-file"),
    (["--allowed-origins", ","], "--allowed-origins needs at least one origin"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[f[0] for f, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_errors(capsys, stories_hf, flags, message):
    from mlx_tfm.cli import main

    assert main(["server", "--model", str(stories_hf), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_generate_does_not_import_the_http_stack(stories_hf):
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "mlx_tfm", "generate", "--model",
                             str(stories_hf), "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "mlx_tfm" in imported  # (the import log is there)
    assert not imported & {"starlette", "uvicorn", "pydantic", "llguidance", "fastapi", "openai", "httpx"}
