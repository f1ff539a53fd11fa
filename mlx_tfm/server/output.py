"""The generated text of a chat answer -> what OpenAI's message holds: ``content``,
``reasoning_content`` (a thinking section, ``<think>...</think>``) and ``tool_calls``
(parsed from the formats of the families we support).

``AnswerParser.feed(text)`` takes the text as it streams and returns a ``Delta`` of what
is certain so far (text that might still open a tag is held back); ``finish()`` flushes
the rest. Streaming and non-streaming answers go through the same parser, so the joined
deltas equal the whole answer.

Tool call formats (``ToolFormat``), chosen from the chat template's text:
    hermes   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5/3)
    llama3   ``{"name": ..., "parameters": {...}}`` as the whole answer, optionally after
             ``<|python_tag|>``; several separated by ``;`` (Llama 3.1-3.3)
    mistral  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker is a
             special token, so it may not show: a bare list also counts)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from enum import Enum

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ToolFormat(Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


# The first marker found in a chat template names its format.
TEMPLATE_MARKERS = (("<tool_call>", ToolFormat.HERMES), ("[TOOL_CALLS]", ToolFormat.MISTRAL),
                    ("<|python_tag|>", ToolFormat.LLAMA3), ("<|start_header_id|>", ToolFormat.LLAMA3))


def tool_format_of(template: str | None) -> ToolFormat:
    """The tool call format a chat template teaches its model (Hermes when it names none)."""
    for marker, tool_format in TEMPLATE_MARKERS:
        if template and marker in template:
            return tool_format
    return ToolFormat.HERMES


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside a thinking section (DeepSeek-R1 and
    Qwen3-style templates write ``<think>`` for the model): the answer starts in it."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __iadd__(self, other: "Delta") -> "Delta":
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``markers``."""
    return max((k for marker in markers for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


START, THINKING, AFTER_THINKING, ANSWER = "start", "thinking", "after_thinking", "answer"


class ReasoningSplitter:
    """Text -> (reasoning, answer): a ``<think>`` at the very start (or a prompt that
    opened one) puts everything up to ``</think>`` in the reasoning. Whitespace around the
    reasoning and before the answer is dropped."""

    def __init__(self, starts_thinking: bool):
        self.state = THINKING if starts_thinking else START
        self.buffer = ""
        self.reasoning_started = False

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        if self.state == START:
            self._leave_start()
        reasoning = self._take_reasoning() if self.state == THINKING else ""
        if self.state == AFTER_THINKING:
            self.buffer = self.buffer.lstrip()
            self.state = ANSWER if self.buffer else AFTER_THINKING
        answer = ""
        if self.state == ANSWER:
            answer, self.buffer = self.buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == THINKING:
            return (rest if self.reasoning_started else rest.lstrip()).rstrip(), ""
        return "", "" if self.state == AFTER_THINKING else rest

    def _leave_start(self) -> None:
        stripped = self.buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.state, self.buffer = THINKING, stripped[len(THINK_OPEN):]
        elif not THINK_OPEN.startswith(stripped):  # (blank, or the start of "<think>": wait)
            self.state = ANSWER

    def _take_reasoning(self) -> str:
        end = self.buffer.find(THINK_CLOSE)
        if end >= 0:
            text, self.buffer = self.buffer[:end].rstrip(), self.buffer[end + len(THINK_CLOSE):]
            self.state = AFTER_THINKING
        else:
            # Keep back what could start "</think>", and trailing blanks (dropped if it follows).
            keep = len(self.buffer) - held_back(self.buffer, (THINK_CLOSE,))
            text = self.buffer[:keep].rstrip()
            self.buffer = self.buffer[len(text):]
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text


@dataclass(frozen=True)
class ToolSyntax:
    """Where a format's tool calls are: after an ``opener`` (consumed) up to ``closer``
    (None: to the end of the answer), or, at the very start of the answer, from a
    ``leading`` text that is part of the calls' JSON."""

    openers: tuple[str, ...]
    closer: str | None
    leading: tuple[str, ...] = ()


SYNTAX = {
    ToolFormat.HERMES: ToolSyntax(openers=("<tool_call>",), closer="</tool_call>"),
    ToolFormat.LLAMA3: ToolSyntax(openers=("<|python_tag|>",), closer=None, leading=("{",)),
    ToolFormat.MISTRAL: ToolSyntax(openers=("[TOOL_CALLS]",), closer=None, leading=("[{",)),
}


class ToolCallParser:
    """Answer text -> content and tool calls. Trailing blanks are held back until more
    content follows, and dropped before a tool call."""

    def __init__(self, tool_format: ToolFormat):
        self.syntax = SYNTAX[tool_format]
        self.buffer = ""
        self.section: str | None = None  # the opener of the tool section we are in
        self.at_start = True
        self.blank = ""  # trailing whitespace of the content, held back
        self.made_calls = False

    def feed(self, text: str) -> Delta:
        self.buffer += text
        delta = Delta()
        while self._step(delta):
            pass
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        if self.section is not None:
            self._close_section(self.buffer, delta, closer="")
        else:
            self._content(self.buffer, delta)
        self.buffer = ""
        if not self.made_calls:
            delta.content += self.blank
        return delta

    def _step(self, delta: Delta) -> bool:
        """Consume what can be decided in the buffer; False when more text is needed."""
        syntax = self.syntax
        if self.section is not None:
            end = self.buffer.find(syntax.closer) if syntax.closer else -1
            if end < 0:
                return False
            body, self.buffer = self.buffer[:end], self.buffer[end + len(syntax.closer):]
            self._close_section(body, delta, closer=syntax.closer)
            return True
        if self.at_start and syntax.leading:
            stripped = self.buffer.lstrip()
            if any(stripped.startswith(lead) for lead in syntax.leading):
                self.section, self.buffer = "", stripped
                return True
            if any(lead.startswith(stripped) for lead in syntax.leading + syntax.openers):
                return False  # blank, or it may still become a tool call
        found = [(i, opener) for opener in syntax.openers if (i := self.buffer.find(opener)) >= 0]
        if found:
            start, opener = min(found)
            self._content(self.buffer[:start], delta)
            self.section, self.buffer = opener, self.buffer[start + len(opener):]
            return True
        keep = len(self.buffer) - held_back(self.buffer, syntax.openers)
        self._content(self.buffer[:keep], delta)
        self.buffer = self.buffer[keep:]
        return False

    def _content(self, text: str, delta: Delta) -> None:
        if not text:
            return
        self.at_start = False
        text = self.blank + text
        said = text.rstrip()
        delta.content += said
        self.blank = text[len(said):]

    def _close_section(self, body: str, delta: Delta, closer: str) -> None:
        opener, self.section = self.section, None
        calls = parse_tool_calls(body)
        if calls is None:  # not tool calls after all: the text is content
            self._content(opener + body + closer, delta)
            return
        self.at_start = False
        self.made_calls = True
        self.blank = ""
        delta.tool_calls += calls


def parse_tool_calls(body: str) -> list[ParsedToolCall] | None:
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
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(name=value["name"], arguments=arguments)


class AnswerParser:
    """A chat answer's text -> Deltas of reasoning, content and tool calls (tool calls
    only when the request offered tools)."""

    def __init__(self, starts_thinking: bool, tool_format: ToolFormat | None):
        self.reasoning = ReasoningSplitter(starts_thinking)
        self.tools = ToolCallParser(tool_format) if tool_format is not None else None

    def feed(self, text: str) -> Delta:
        reasoning, answer = self.reasoning.feed(text)
        return self._answer(reasoning, answer, finishing=False)

    def finish(self) -> Delta:
        reasoning, answer = self.reasoning.finish()
        return self._answer(reasoning, answer, finishing=True)

    def _answer(self, reasoning: str, answer: str, finishing: bool) -> Delta:
        if self.tools is None:
            return Delta(content=answer, reasoning=reasoning)
        delta = Delta(reasoning=reasoning)
        delta += self.tools.feed(answer)
        if finishing:
            delta += self.tools.finish()
        return delta
