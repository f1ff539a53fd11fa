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

import json

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


def tool_call_grammar(request: ChatCompletionRequest, tool_format: ToolFormat) -> str | None:
    """For tool_choice "required" or a named function: a grammar that makes the answer a
    call of one of the allowed tools, in the model's own format."""
    from llguidance import LLMatcher

    choice = request.tool_choice
    if not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    tools = [t for t in request.tools if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
    arguments_key = "parameters" if tool_format == ToolFormat.LLAMA3 else "arguments"
    schema = {"anyOf": [call_schema(tool, arguments_key) for tool in tools], "x-guidance": COMPACT_JSON}
    body = {
        ToolFormat.HERMES: '"<tool_call>\\n" call "\\n</tool_call>"',
        ToolFormat.LLAMA3: "call",
        ToolFormat.MISTRAL: '"[" call "]"',
    }[tool_format]
    return LLMatcher.grammar_from_lark(f"start: {body}\ncall: %json {json.dumps(schema)}\n")


def call_schema(tool: Tool, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, arguments_key: tool.function.parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
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
