"""The tool call formats of the families we serve: where a format's calls sit in the
answer (``ToolSyntax``: the markers that open and close a tool section) and how a
section's text becomes calls (one parser per format), chosen by ``ToolFormat`` from the
table ``SYNTAX``. The streaming around it (content held back while a marker may still
open, sections cut out of the text) is output.py's ``ToolCallParser``; gpt-oss's harmony
channels are output.py's ``HarmonyParser``.

    hermes          ``<tool_call>{"name": f, "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5 / 3)
    qwen3_coder     ``<tool_call><function=f><parameter=k>v</parameter></function></tool_call>``
    llama3_json     ``{"name": f, "parameters": {...}}`` as the whole answer, after an optional
                    ``<|python_tag|>``; several separated by ``;`` (Llama 3.1-3.3, Llama 4 JSON)
    pythonic        ``[f(k="v", n=3), g()]`` (Llama 3.2 / 4 pythonic, LFM2's ``<|tool_call_start|>``)
    mistral         ``[TOOL_CALLS][{"name": f, "arguments": {...}}]`` or, since Mistral Small 3.2 /
                    Magistral, ``[TOOL_CALLS]f[ARGS]{...}`` (the bare list also counts: the marker
                    is a special token)
    gemma4          ``<|tool_call>call:f{k:<|"|>v<|"|>,n:3}<tool_call|>``
    function_gemma  ``<start_function_call>call:f{k:<escape>v<escape>}<end_function_call>``
    glm45           ``<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`` (GLM-4.5-4.7)
    kimi_k2         ``<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                    <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>``
    harmony         gpt-oss: ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>``
    deepseek_v31    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
                    <｜tool▁calls▁end｜>`` (and V3's ``function<｜tool▁sep｜>f`` with a fenced JSON block)
    minimax_m2      ``<minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke>
                    </minimax:tool_call>``

Parameter values written as text (the XML formats) become JSON values by the type the
tool's JSON schema gives them (integer, number, boolean, object, array; strings stay
text), as the families' own parsers do; a parameter the schema does not type is JSON when
it parses as JSON, else text.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from ..errors import UserError

Schemas = dict[str, dict]  # tool name -> its parameters' JSON schema


class ToolFormat(Enum):
    HERMES = "hermes"
    QWEN3_CODER = "qwen3_coder"
    LLAMA3 = "llama3_json"
    PYTHONIC = "pythonic"
    MISTRAL = "mistral"
    GEMMA4 = "gemma4"
    FUNCTION_GEMMA = "function_gemma"
    GLM45 = "glm45"
    KIMI_K2 = "kimi_k2"
    HARMONY = "harmony"
    DEEPSEEK_V31 = "deepseek_v31"
    MINIMAX_M2 = "minimax_m2"


# Other servers' names for the same formats (vLLM's and mlx-lm's), accepted by --tool-call-parser.
ALIASES = {"llama3": ToolFormat.LLAMA3, "llama4_json": ToolFormat.LLAMA3, "llama4_pythonic": ToolFormat.PYTHONIC,
           "json_tools": ToolFormat.HERMES, "glm47": ToolFormat.GLM45, "openai": ToolFormat.HARMONY,
           "gpt_oss": ToolFormat.HARMONY, "deepseek_v3": ToolFormat.DEEPSEEK_V31}

# The first marker found in a chat template names its format: the more specific markers
# come first (Qwen3-Coder's and GLM's templates also write <tool_call>).
TEMPLATE_MARKERS = (
    ("<minimax:tool_call>", ToolFormat.MINIMAX_M2), ("<|tool_call>", ToolFormat.GEMMA4),
    ("<start_function_call>", ToolFormat.FUNCTION_GEMMA), ("<arg_key>", ToolFormat.GLM45),
    ("<function=", ToolFormat.QWEN3_CODER), ("<|tool_calls_section_begin|>", ToolFormat.KIMI_K2),
    ("<｜tool▁calls▁begin｜>", ToolFormat.DEEPSEEK_V31), ("<|channel|>", ToolFormat.HARMONY),
    ("[func_name1(", ToolFormat.PYTHONIC), ("<|tool_call_start|>", ToolFormat.PYTHONIC),
    ("<tool_call>", ToolFormat.HERMES), ("[TOOL_CALLS]", ToolFormat.MISTRAL),
    ("<|python_tag|>", ToolFormat.LLAMA3), ("<|start_header_id|>", ToolFormat.LLAMA3),
    ("<|header_start|>", ToolFormat.LLAMA3),
)


def tool_format_of(template: str | None) -> ToolFormat:
    """The tool call format a chat template teaches its model (Hermes when it names none)."""
    for marker, tool_format in TEMPLATE_MARKERS:
        if template and marker in template:
            return tool_format
    return ToolFormat.HERMES


def tool_format_named(name: str) -> ToolFormat:
    """The format a --tool-call-parser value names, or a UserError listing the names."""
    by_name = {f.value: f for f in ToolFormat} | ALIASES
    if name not in by_name:
        raise UserError(f"--tool-call-parser: unknown format {name!r}; known: {', '.join(sorted(by_name))}")
    return by_name[name]


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def json_text(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- parameter values by the schema's types ------------------------------------------------


def schema_type(schema: dict | None) -> str | None:
    """The one JSON type a parameter's schema names (the first besides null), or None."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def typed_value(text: str, schema: dict | None):
    """A parameter's text as the JSON value its schema types it (text that does not fit
    the type stays text)."""
    kind = schema_type(schema)
    if kind == "string":
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = python_value(text) if kind in ("object", "array") else None
        return text if value is None else value
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def python_value(text: str):
    """A Python literal ({'a': 1}, [1, 2], True) some models write for an object or array."""
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, (dict, list)) else None


def typed_arguments(name: str, pairs: list[tuple[str, str]], schemas: Schemas) -> str:
    """``(parameter, text)`` pairs of a call of ``name`` -> its arguments as JSON text."""
    properties = (schemas.get(name) or {}).get("properties") or {}
    return json_text({key: typed_value(value, properties.get(key)) for key, value in pairs})


# -- matching a section against one pattern -------------------------------------------------


def whole_matches(pattern: re.Pattern, text: str) -> list[re.Match] | None:
    """The matches of ``pattern`` that make up all of ``text`` (blanks between them
    allowed); None when anything else is there, or nothing matched."""
    matches, position = [], 0
    for match in pattern.finditer(text):
        if text[position:match.start()].strip():
            return None
        matches.append(match)
        position = match.end()
    if not matches or text[position:].strip():
        return None
    return matches


def json_object_text(text: str) -> str | None:
    """``text`` when it is one JSON object (blanks around it allowed), as compact JSON."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return json_text(value) if isinstance(value, dict) else None


# -- JSON formats (hermes, llama3_json, mistral's list) -------------------------------------


def json_calls(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """The calls in a tool section: JSON objects ``{"name", "arguments" | "parameters"}``,
    or lists of them, separated by blanks, commas or semicolons. None if anything else is
    there."""
    decoder = json.JSONDecoder()
    values, position = [], 0
    while True:
        while position < len(body) and body[position] in " \t\r\n;,":
            position += 1
        if position == len(body):
            break
        try:
            value, position = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return None
        values += value if isinstance(value, list) else [value]
    calls = [tool_call_of(value) for value in values]
    return calls if calls and all(calls) else None


def tool_call_of(value) -> ParsedToolCall | None:
    """A call is an object with a name and its arguments (any other JSON is content)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if "arguments" not in value and "parameters" not in value:
        return None
    arguments = value["arguments"] if "arguments" in value else value["parameters"]
    if not isinstance(arguments, str):
        arguments = json_text(arguments)
    return ParsedToolCall(name=value["name"], arguments=arguments)


def mistral_calls(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """``[{...}, ...]`` (v3 tokenizers), or ``f[ARGS]{...}`` per ``[TOOL_CALLS]`` (v11+;
    v13 may write ``f[CALL_ID]id[ARGS]{...}``)."""
    if "[ARGS]" not in body:
        return json_calls(body, schemas)
    calls = []
    for part in body.split("[TOOL_CALLS]"):
        if not part.strip():
            continue
        head, found, arguments = part.partition("[ARGS]")
        name = head.split("[CALL_ID]")[0].strip()
        arguments = json_object_text(arguments) if found else None
        if not name or arguments is None:
            return None
        calls.append(ParsedToolCall(name=name, arguments=arguments))
    return calls or None


# -- pythonic ([f(k=v), ...]) ------------------------------------------------------------------

JSON_NAMES = {"true": True, "false": False, "null": None}  # what some models write in Python calls


def literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {literal(key): literal(value) for key, value in zip(node.keys, node.values)}
    return ast.literal_eval(node)  # (a ValueError for anything that is not a literal)


def pythonic_calls(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """``[f(k="v"), g()]``: a Python list of calls with keyword arguments, literals only."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            arguments = {keyword.arg: literal(keyword.value) for keyword in node.keywords}
        except (ValueError, TypeError):
            return None
        if None in arguments:  # a **kwargs
            return None
        calls.append(ParsedToolCall(name=ast.unparse(node.func), arguments=json_text(arguments)))
    return calls


# -- XML formats: parameters as text, typed by the schema ------------------------------------

QWEN_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def one_newline_off(text: str) -> str:
    """Qwen3-Coder writes each value on lines of its own: one newline either side is markup."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def xml_pairs(pattern: re.Pattern, body: str, clean: Callable[[str], str]) -> list[tuple[str, str]] | None:
    """The (name, value) pairs of ``pattern`` that make up ``body`` (an empty body: none)."""
    if not body.strip():
        return []
    matches = whole_matches(pattern, body)
    return None if matches is None else [(m.group(1).strip(), clean(m.group(2))) for m in matches]


def xml_calls(function: re.Pattern, parameter: re.Pattern, clean: Callable[[str], str]):
    """A parser of sections made of ``function`` elements (group 1 the name, group 2 the
    parameters) holding ``parameter`` elements (group 1 the key, group 2 the value text,
    tidied by ``clean``): Qwen3-Coder's <function=f>, MiniMax's <invoke name="f">."""
    def parse(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
        calls = []
        for match in whole_matches(function, body) or []:
            name = match.group(1).strip()
            pairs = xml_pairs(parameter, match.group(2), clean)
            if pairs is None:
                return None
            calls.append(ParsedToolCall(name=name, arguments=typed_arguments(name, pairs, schemas)))
        return calls or None

    return parse


qwen3_coder_calls = xml_calls(QWEN_FUNCTION, QWEN_PARAMETER, one_newline_off)
minimax_calls = xml_calls(MINIMAX_INVOKE, MINIMAX_PARAMETER, str.strip)


def glm_calls(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """``f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>``: the name, then the pairs."""
    start = body.find("<arg_key>")
    name = (body if start < 0 else body[:start]).strip()
    if not name or any(c in name for c in "<>{}\n "):
        return None
    pairs = xml_pairs(GLM_ARGUMENT, "" if start < 0 else body[start:], str.strip)
    return None if pairs is None else [ParsedToolCall(name=name, arguments=typed_arguments(name, pairs, schemas))]


# -- Gemma: call:f{k:<escape>v<escape>,n:3} ----------------------------------------------------


class GemmaArguments:
    """Gemma's argument literal: ``{key:value,...}`` with bare keys, strings between
    ``quote`` marks (``<escape>``, Gemma 4's ``<|"|>``), nested objects and lists, and
    bare numbers / booleans. ``parse()`` raises ValueError on anything else."""

    def __init__(self, text: str, quote: str):
        self.text, self.quote, self.position = text, quote, 0

    def parse_call(self) -> ParsedToolCall:
        self.expect("call:")
        start = self.position
        while self.position < len(self.text) and self.text[self.position] not in "{ ":
            self.position += 1
        name = self.text[start:self.position]
        arguments = self.value()
        if not name or not isinstance(arguments, dict):
            raise ValueError("not a call")
        return ParsedToolCall(name=name, arguments=json_text(arguments))

    def expect(self, mark: str) -> None:
        self.skip_blanks()
        if not self.text.startswith(mark, self.position):
            raise ValueError(f"expected {mark!r}")
        self.position += len(mark)

    def skip_blanks(self) -> None:
        while self.position < len(self.text) and self.text[self.position].isspace():
            self.position += 1

    def value(self):
        self.skip_blanks()
        if self.text.startswith(self.quote, self.position):
            end = self.text.find(self.quote, self.position + len(self.quote))
            if end < 0:
                raise ValueError("an unclosed string")
            start, self.position = self.position + len(self.quote), end + len(self.quote)
            return self.text[start:end]
        if self.text.startswith("{", self.position):
            return dict(self.items("}", keyed=True))
        if self.text.startswith("[", self.position):
            return [item for _, item in self.items("]", keyed=False)]
        return self.bare()

    def items(self, closer: str, keyed: bool) -> list[tuple[str | None, object]]:
        self.position += 1  # the opening bracket
        items = []
        self.skip_blanks()
        while not self.text.startswith(closer, self.position):
            if items:
                self.expect(",")
            key = None
            if keyed:
                colon = self.text.find(":", self.position)
                # (keys are bare; a JSON-quoted one, as in a JSON object value, loses its quotes)
                key = self.text[self.position:colon].strip().strip('"') if colon > 0 else ""
                if not key:
                    raise ValueError("a key without a value")
                self.position = colon + 1
            items.append((key, self.value()))
            self.skip_blanks()
        self.position += len(closer)
        return items

    def bare(self):
        start = self.position
        while self.position < len(self.text) and self.text[self.position] not in ",}]":
            self.position += 1
        text = self.text[start:self.position].strip()
        if not text:
            raise ValueError("an empty value")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


def gemma_calls(quote: str) -> Callable[[str, Schemas], list[ParsedToolCall] | None]:
    def parse(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
        reader, calls = GemmaArguments(body, quote), []
        try:
            while body[reader.position:].strip():
                calls.append(reader.parse_call())
        except ValueError:
            return None
        return calls or None

    return parse


# -- special-token formats: Kimi K2, DeepSeek V3 / V3.1 ----------------------------------------

KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(\S+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                       re.DOTALL)
DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
DEEPSEEK_V3_BLOCK = re.compile(r"\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def kimi_calls(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """``functions.f:0`` names the call and is its id (the template writes the id back
    that way on the next turn)."""
    matches = whole_matches(KIMI_CALL, body)
    calls = []
    for match in matches or []:
        call_id, arguments = match.group(1), json_object_text(match.group(2))
        name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
        if arguments is None or not name:
            return None
        calls.append(ParsedToolCall(name=name, arguments=arguments, id=call_id))
    return calls or None


def deepseek_calls(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
    """V3.1: ``f<｜tool▁sep｜>{...}``; V3: ``function<｜tool▁sep｜>f\\n```json\\n{...}\\n```"``."""
    calls = []
    for match in whole_matches(DEEPSEEK_CALL, body) or []:
        name, arguments = match.group(1).strip(), match.group(2)
        if name == "function":  # V3's form: the name and a fenced block follow the separator
            fenced = DEEPSEEK_V3_BLOCK.fullmatch(arguments)
            if fenced is None:
                return None
            name, arguments = fenced.group(1), fenced.group(2)
        arguments = json_object_text(arguments)
        if arguments is None or not name:
            return None
        calls.append(ParsedToolCall(name=name, arguments=arguments))
    return calls or None


def first_of(*parsers: Callable[[str, Schemas], list[ParsedToolCall] | None]):
    """The calls of the first parser that reads the section (Qwen3-Coder and GLM models
    sometimes write Hermes' JSON inside their <tool_call>)."""
    def parse(body: str, schemas: Schemas) -> list[ParsedToolCall] | None:
        return next((calls for parser in parsers if (calls := parser(body, schemas)) is not None), None)

    return parse


# -- the table ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSyntax:
    """Where a format's tool calls are: after one of the ``openers`` (consumed) up to the
    first of the ``closers`` (or the end of the answer), or, at the very start of the
    answer, from a ``leading`` text that is part of the calls; ``parse`` turns the
    section's text into calls (None: it was content after all)."""

    openers: tuple[str, ...]
    closers: tuple[str, ...]
    parse: Callable[[str, Schemas], list[ParsedToolCall] | None]
    leading: tuple[str, ...] = ()


SYNTAX = {
    ToolFormat.HERMES: ToolSyntax(("<tool_call>",), ("</tool_call>",), json_calls),
    ToolFormat.QWEN3_CODER: ToolSyntax(("<tool_call>",), ("</tool_call>",), first_of(qwen3_coder_calls, json_calls)),
    ToolFormat.LLAMA3: ToolSyntax(("<|python_tag|>",), (), json_calls, leading=("{",)),
    ToolFormat.PYTHONIC: ToolSyntax(("<|python_start|>", "<|tool_call_start|>"), ("<|python_end|>", "<|tool_call_end|>"),
                                    pythonic_calls, leading=("[",)),
    ToolFormat.MISTRAL: ToolSyntax(("[TOOL_CALLS]",), (), mistral_calls, leading=("[{",)),
    ToolFormat.GEMMA4: ToolSyntax(("<|tool_call>",), ("<tool_call|>",), gemma_calls('<|"|>')),
    ToolFormat.FUNCTION_GEMMA: ToolSyntax(("<start_function_call>",), ("<end_function_call>",),
                                          gemma_calls("<escape>")),
    ToolFormat.GLM45: ToolSyntax(("<tool_call>",), ("</tool_call>",), first_of(glm_calls, json_calls)),
    ToolFormat.KIMI_K2: ToolSyntax(("<|tool_calls_section_begin|>",), ("<|tool_calls_section_end|>",), kimi_calls),
    ToolFormat.DEEPSEEK_V31: ToolSyntax(("<｜tool▁calls▁begin｜>",), ("<｜tool▁calls▁end｜>",), deepseek_calls),
    ToolFormat.MINIMAX_M2: ToolSyntax(("<minimax:tool_call>",), ("</minimax:tool_call>",), minimax_calls),
}

# The markers inside a format's tool section, besides its openers and closers.
INNER_MARKERS = {
    ToolFormat.MISTRAL: ("[ARGS]", "[CALL_ID]"),
    ToolFormat.GEMMA4: ('<|"|>',),
    ToolFormat.FUNCTION_GEMMA: ("<escape>",),
    ToolFormat.KIMI_K2: ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    ToolFormat.DEEPSEEK_V31: ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
}


def markers_of(tool_format: ToolFormat) -> tuple[str, ...]:
    """Every marker a format's calls are written with. Tokenizers often keep them as
    special tokens, which have no text: the server writes them back into the answer's
    text so that the parser sees them."""
    syntax = SYNTAX.get(tool_format)
    written = syntax.openers + syntax.closers if syntax else ()
    return written + INNER_MARKERS.get(tool_format, ())


__all__ = ["ToolFormat", "ToolSyntax", "SYNTAX", "ParsedToolCall", "tool_format_of", "tool_format_named",
           "typed_value", "markers_of"]
