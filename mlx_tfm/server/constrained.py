"""Constrained decoding through llguidance: ``response_format`` (json_object, json_schema)
and forced tool calls (``tool_choice`` "required" or a named function) become a grammar,
and the grammar a per-row logits processor that sets every token it does not allow to
-inf. The output then always parses (and validates against the schema) unless it is cut
by ``max_tokens``.

llguidance needs the vocabulary as bytes: ``Tokenizer.token_bytes()`` (what the streaming
detokenizer uses). Control tokens (BOS, EOS, ...) get llguidance's marker for special
tokens, so no grammar can produce them except EOS when the grammar is complete.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Callable

import mlx.core as mx
import numpy as np

from ..tokenizer import Tokenizer
from .errors import invalid
from .output import ToolFormat
from .protocol import ChatCompletionRequest, NamedToolChoice, Tool

SPECIAL_TOKEN_PREFIX = b"\xff"  # llguidance's mark for a token that is not text
COMPACT_JSON = {"whitespace_flexible": False}  # no run-away blanks between JSON items


class VocabularyForGrammar:
    """What ``llguidance.LLTokenizer`` reads from a tokenizer: each token's bytes, the EOS
    and BOS ids, the special token ids, and a function from text to ids."""

    def __init__(self, tokenizer: Tokenizer, token_bytes: list[bytes]):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i, piece in enumerate(token_bytes) if not piece]
        self.tokens = [piece or SPECIAL_TOKEN_PREFIX + f"<special_{i}>".encode() for i, piece in enumerate(token_bytes)]
        self._ids_of_piece = {piece: i for i, piece in reversed(list(enumerate(token_bytes))) if piece}
        self._longest = max(map(len, token_bytes))

    def __call__(self, text: str | bytes) -> list[int]:
        """Ids that spell exactly ``text``: the tokenizer's own when they do (SentencePiece
        would add a leading space), else the longest pieces, greedily."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False)
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        ids, position = [], 0
        while position < len(data):
            for length in range(min(self._longest, len(data) - position), 0, -1):
                token = self._ids_of_piece.get(data[position:position + length])
                if token is not None:
                    ids.append(token)
                    position += length
                    break
            else:
                position += 1  # a byte no token spells: skip it (llguidance only asks for valid text)
        return ids


def grammar_tokenizer(tokenizer: Tokenizer):
    """llguidance's view of ``tokenizer`` (built once per model; ~1 s for 150k tokens), or
    None when the tokenizer has no per-token bytes."""
    from llguidance import LLTokenizer, TokenizerWrapper

    token_bytes = tokenizer.token_bytes()
    if token_bytes is None:
        return None
    vocabulary = VocabularyForGrammar(tokenizer, token_bytes)
    return LLTokenizer(TokenizerWrapper(vocabulary), eos_token=sorted(tokenizer.eos_token_ids))


# -- grammars ----------------------------------------------------------------------------


def response_grammar(request: ChatCompletionRequest) -> str | None:
    """The grammar ``response_format`` asks for (None: free text)."""
    from llguidance import LLMatcher

    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    schema = {"type": "object"} if response_format.type == "json_object" else response_format.json_schema.schema_
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
    except ValueError as e:
        raise invalid("response_format", f"response_format: not a usable JSON schema ({e})") from None


def tool_call_grammar(request: ChatCompletionRequest, tool_format: ToolFormat,
                      special: dict[str, int] | None = None) -> str | None:
    """For tool_choice "required" or a named function: a grammar that makes the answer a
    call of one of the allowed tools, in the model's own format, its arguments held to the
    tool's schema. ``special``: the format's markers that are special tokens (text -> id),
    which the grammar names by id (as text they could never be written)."""
    from llguidance import LLMatcher

    choice = request.tool_choice
    if not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    tools = [t for t in request.tools if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
    special = special or {}
    literal = functools.partial(lark_literal, special=special)
    if tool_format == ToolFormat.MISTRAL and "[ARGS]" in special:  # v11+ tokenizers: [TOOL_CALLS]f[ARGS]{...}
        tool_format = MISTRAL_NAME_ARGS
    elif tool_format in JSON_CALL_BODIES:
        arguments_key = "parameters" if tool_format == ToolFormat.LLAMA3 else "arguments"
        schema = {"anyOf": [call_schema(tool, arguments_key) for tool in tools], "x-guidance": COMPACT_JSON}
        body = JSON_CALL_BODIES[tool_format].format(tool_calls=literal("[TOOL_CALLS]") if "[TOOL_CALLS]" in special else "")
        return LLMatcher.grammar_from_lark(f"start: {body}\ncall: %json {json.dumps(schema)}\n")
    write = CALL_WRITERS[tool_format]
    rules = [f"call_{i}: {write(tool.function.name, parameters_of(tool), literal)}" for i, tool in enumerate(tools)]
    start = "start: " + " | ".join(f"call_{i}" for i in range(len(tools)))
    return LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n")


# Formats whose whole call is one JSON object: a schema of {"name", arguments} per tool.
JSON_CALL_BODIES = {
    ToolFormat.HERMES: '"<tool_call>\\n" call "\\n</tool_call>"',
    ToolFormat.LLAMA3: "call",
    # [TOOL_CALLS] first when the tokenizer has it as a special token (as text no model writes it)
    ToolFormat.MISTRAL: '{tool_calls} "[" call "]"',
}
MISTRAL_NAME_ARGS = "mistral [ARGS]"  # CALL_WRITERS' key for the form since Mistral's v11 tokenizers


def call_schema(tool: Tool, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, arguments_key: parameters_of(tool)},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def parameters_of(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def lark_literal(text: str, special: dict[str, int]) -> str:
    """``text`` as a lark expression: its special-token markers by id (``<[id]>``), the
    rest as strings."""
    pieces = re.split("(" + "|".join(map(re.escape, special)) + ")", text) if special else [text]
    return " ".join(f"<[{special[p]}]>" if p in special else json.dumps(p, ensure_ascii=False) for p in pieces if p)


def json_value(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})


def text_value(schema: dict) -> str:
    """A parameter's value as the XML formats write it: a string as bare text (one of
    its enum's values when it has one), anything else as JSON."""
    enum = schema.get("enum")
    if enum and all(isinstance(value, str) for value in enum):
        return "(" + " | ".join(json.dumps(value, ensure_ascii=False) for value in enum) + ")"
    if schema.get("type") != "string":
        return json_value(schema)
    shortest, longest = schema.get("minLength", 0), schema.get("maxLength", "")
    return f"/[^<]{{{shortest},{longest}}}/"  # (a "<" would start the closing tag)


def each_parameter(parameters: dict, write: Callable[[str, dict], str], separator: str = "") -> str:
    """The parameters in the schema's order, each written by ``write(name, schema)``:
    the required ones always, the others optional (with a ``separator``: required ones only)."""
    required = set(parameters.get("required") or ())
    items = []
    for name, schema in (parameters.get("properties") or {}).items():
        if name in required:
            items.append(write(name, schema))
        elif not separator:
            items.append(f"({write(name, schema)})?")
    return f" {separator} ".join(items) if separator else " ".join(items)


def between(literal, before: str, value: str, after: str) -> str:
    """``value`` (a lark expression) between two texts."""
    return f"{literal(before)} {value} {literal(after)}"


def qwen3_coder_call(name: str, parameters: dict, literal) -> str:
    def parameter(key: str, schema: dict) -> str:
        return between(literal, f"<parameter={key}>\n", text_value(schema), "\n</parameter>\n")

    return between(literal, f"<tool_call>\n<function={name}>\n", each_parameter(parameters, parameter),
                   "</function>\n</tool_call>")


def glm_call(name: str, parameters: dict, literal) -> str:
    def parameter(key: str, schema: dict) -> str:
        return between(literal, f"<arg_key>{key}</arg_key>\n<arg_value>", text_value(schema), "</arg_value>\n")

    return between(literal, f"<tool_call>{name}\n", each_parameter(parameters, parameter), "</tool_call>")


def minimax_call(name: str, parameters: dict, literal) -> str:
    def parameter(key: str, schema: dict) -> str:
        return between(literal, f"<parameter name={json.dumps(key)}>", text_value(schema), "</parameter>\n")

    return between(literal, f"<minimax:tool_call>\n<invoke name={json.dumps(name)}>\n",
                   each_parameter(parameters, parameter), "</invoke>\n</minimax:tool_call>")


def gemma_call(opener: str, closer: str, quote: str):
    """``call:f{k:<quote>text<quote>,n:3}`` between the format's markers."""
    def write(name: str, parameters: dict, literal) -> str:
        def parameter(key: str, schema: dict) -> str:
            if text_value(schema) == json_value(schema):
                return f"{literal(key + ':')} {json_value(schema)}"
            return between(literal, key + ":" + quote, text_value(schema), quote)

        body = each_parameter(parameters, parameter, separator=literal(","))
        return between(literal, f"{opener}call:{name}{{", body, "}" + closer)

    return write


def pythonic_call(name: str, parameters: dict, literal) -> str:
    """``[f(k=v, ...)]`` with JSON values (the parser reads true / false / null too)."""
    body = each_parameter(parameters, lambda key, schema: f"{literal(key + '=')} {json_value(schema)}",
                          separator=literal(", "))
    return between(literal, f"[{name}(", body, ")]")


def json_arguments_call(before: str, after: str):
    """A format whose arguments are one JSON object between markers (``{name}`` in them)."""
    def write(name: str, parameters: dict, literal) -> str:
        return f"{literal(before.format(name=name))} {json_value(parameters)} {literal(after)}".strip()

    return write


CALL_WRITERS = {
    ToolFormat.QWEN3_CODER: qwen3_coder_call,
    ToolFormat.GLM45: glm_call,
    ToolFormat.MINIMAX_M2: minimax_call,
    ToolFormat.GEMMA4: gemma_call("<|tool_call>", "<tool_call|>", '<|"|>'),
    ToolFormat.FUNCTION_GEMMA: gemma_call("<start_function_call>", "<end_function_call>", "<escape>"),
    ToolFormat.PYTHONIC: pythonic_call,
    MISTRAL_NAME_ARGS: json_arguments_call("[TOOL_CALLS]{name}[ARGS]", ""),
    ToolFormat.KIMI_K2: json_arguments_call(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
        "<|tool_call_end|><|tool_calls_section_end|>"),
    ToolFormat.DEEPSEEK_V31: json_arguments_call("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
                                                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    # <|call|> that ends the message is an EOS token of gpt-oss: the answer ends there.
    ToolFormat.HARMONY: json_arguments_call("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""),
}


# -- the logits processor ------------------------------------------------------------------


class GrammarProcessor:
    """A per-row logits processor: tokens the grammar does not allow next get -inf.

    Called by the engine once per generated token with every token so far (prompt
    included); the tokens generated since the last call are fed to the matcher first.
    The mask covers the model's whole vocabulary (``vocab_size``), which is often larger
    than the tokenizer's (``tokenizer_size``: models round their embedding rows up): the
    ids past the tokenizer's are no text and never allowed."""

    def __init__(self, matcher, vocab_size: int, tokenizer_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.known = min(tokenizer_size, vocab_size)  # the ids the grammar decides on
        self.seen: int | None = None  # how many of the tokens the matcher has taken in

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.seen is None:
            self.seen = tokens.size  # the first call: all of it is the prompt
        for token in tokens[self.seen:].tolist():
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"constrained decoding: {self.matcher.get_error()}")
        self.seen = tokens.size
        # llguidance's bitmask: one bit per tokenizer id, in 32-bit words (its tail is padding)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.zeros(self.vocab_size, dtype=bool)  # (V,) the model's ids; past the tokenizer's stay banned
        allowed[: self.known] = bits[: self.known]
        return mx.where(mx.array(allowed), logits, float("-inf"))


def make_processor(grammar_tokenizer, grammar: str, vocab_size: int, param: str) -> GrammarProcessor:
    """A fresh processor over the model's ``vocab_size`` ids (one per row: the matcher
    keeps state) or a 400 on a bad grammar."""
    from llguidance import LLMatcher

    if grammar_tokenizer is None:
        raise invalid(param, f"{param} needs per-token bytes, which this model's tokenizer does not provide")
    matcher = LLMatcher(grammar_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise invalid(param, f"{param}: the grammar cannot be enforced ({matcher.get_error().splitlines()[0]})")
    return GrammarProcessor(matcher, vocab_size, grammar_tokenizer.vocab_size)


__all__ = ["grammar_tokenizer", "response_grammar", "tool_call_grammar", "make_processor", "GrammarProcessor"]
