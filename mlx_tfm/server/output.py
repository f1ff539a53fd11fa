"""The generated text of a chat answer -> what OpenAI's message holds: ``content``,
``reasoning_content`` (a thinking section, ``<think>...</think>``) and ``tool_calls``
(parsed from the formats of the families we support).

``AnswerParser.feed(text)`` takes the text as it streams and returns a ``Delta`` of what
is certain so far (text that might still open a tag is held back); ``finish()`` flushes
the rest. Streaming and non-streaming answers go through the same parser, so the joined
deltas equal the whole answer.

The tool call formats (``ToolFormat``, one parser each) are tool_formats.py's; a format
is chosen from the chat template's text or by ``--tool-call-parser``. Reasoning
(``ReasoningFormat``): ``<think>...</think>`` at the start of the answer (or opened by the
prompt), or gpt-oss's harmony channels (``HarmonyParser``: analysis -> reasoning, final ->
content, a message to a function -> a tool call); chosen from the template or by
``--reasoning-parser``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

from ..errors import UserError
from .tool_formats import SYNTAX, ParsedToolCall, Schemas, ToolFormat, json_object_text, tool_format_of

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside a thinking section (DeepSeek-R1 and
    Qwen3-style templates write ``<think>`` for the model): the answer starts in it."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


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


class ToolCallParser:
    """Answer text -> content and tool calls. Trailing blanks are held back until more
    content follows, and dropped before a tool call."""

    def __init__(self, tool_format: ToolFormat, schemas: Schemas | None = None):
        self.syntax = SYNTAX[tool_format]
        self.schemas = schemas or {}  # the offered tools' parameter schemas (types the XML formats' values)
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
            ends = [(i, closer) for closer in syntax.closers if (i := self.buffer.find(closer)) >= 0]
            if not ends:
                return False
            end, closer = min(ends)
            body, self.buffer = self.buffer[:end], self.buffer[end + len(closer):]
            self._close_section(body, delta, closer=closer)
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
        calls = self.syntax.parse(body, self.schemas)
        if calls is None:  # not tool calls after all: the text is content
            self._content(opener + body + closer, delta)
            return
        self.at_start = False
        self.made_calls = True
        self.blank = ""
        delta.tool_calls += calls


class HarmonyParser:
    """gpt-oss's answer in harmony messages: ``[<|start|>assistant]<|channel|>NAME
    [to=functions.f] [<|constrain|>json]<|message|>TEXT`` ended by ``<|end|>``, ``<|call|>``
    or ``<|return|>`` (or the end of the answer: the last two are EOS tokens). The analysis
    channel is reasoning; a message to ``functions.f`` a call of f (when tools were offered;
    else its text is content); any other message content. Text without a header is content."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>") + ENDS  # special tokens in gpt-oss

    def __init__(self, calls: bool):
        self.calls = calls
        self.buffer = ""
        self.header: str | None = None  # the header of the message we are in (None: between messages)

    def feed(self, text: str) -> Delta:
        self.buffer += text
        delta = Delta()
        while self._step(delta):
            pass
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        if self.header is not None:
            self._end_message(self.buffer, delta)
        self.buffer, self.header = "", None  # (a header cut short is markup, not text)
        return delta

    def _step(self, delta: Delta) -> bool:
        if self.header is None:
            stripped = self.buffer.lstrip()
            if not stripped.startswith("<|") and not "<|".startswith(stripped):
                self.header, self.buffer = "", stripped  # plain text: content
                return True
            start = stripped.find("<|message|>")
            if start < 0:
                return False
            self.header, self.buffer = stripped[:start], stripped[start + len("<|message|>"):]
            return True
        ends = [(i, end) for end in self.ENDS if (i := self.buffer.find(end)) >= 0]
        if ends:
            position, end = min(ends)
            body, self.buffer = self.buffer[:position], self.buffer[position + len(end):]
            self._end_message(body, delta)
            self.header = None
            return True
        if self._recipient() is None:  # reasoning and content stream; a call waits for its end
            keep = len(self.buffer) - held_back(self.buffer, self.ENDS)
            self._say(self.buffer[:keep], delta)
            self.buffer = self.buffer[keep:]
        return False

    def _recipient(self) -> str | None:
        """The function this message calls (None: it is text)."""
        match = HARMONY_RECIPIENT.search(self.header or "")
        return match.group(1) if match and self.calls else None

    def _say(self, text: str, delta: Delta) -> None:
        channel = HARMONY_CHANNEL.search(self.header or "")
        if channel and channel.group(1) == "analysis":
            delta.reasoning += text
        else:
            delta.content += text

    def _end_message(self, body: str, delta: Delta) -> None:
        name = self._recipient()
        arguments = json_object_text(body) if name else None
        if arguments is None:
            self._say(body, delta)
        else:
            delta.tool_calls.append(ParsedToolCall(name=name, arguments=arguments))


HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class ReasoningFormat(Enum):
    THINK = "think"  # <think>...</think> (DeepSeek-R1, Qwen 3, GLM, MiniMax, Kimi thinking)
    HARMONY = "harmony"  # gpt-oss's analysis channel
    NONE = "none"  # no reasoning section: all of the answer is the answer


REASONING_ALIASES = {"deepseek_r1": ReasoningFormat.THINK, "qwen3": ReasoningFormat.THINK,
                     "openai": ReasoningFormat.HARMONY, "gpt_oss": ReasoningFormat.HARMONY}


def reasoning_format_of(template: str | None) -> ReasoningFormat:
    """Harmony for a template that writes harmony channels, else ``<think>``."""
    return ReasoningFormat.HARMONY if template and "<|channel|>" in template else ReasoningFormat.THINK


def reasoning_format_named(name: str) -> ReasoningFormat:
    """The format a --reasoning-parser value names, or a UserError listing the names."""
    by_name = {f.value: f for f in ReasoningFormat} | REASONING_ALIASES
    if name not in by_name:
        raise UserError(f"--reasoning-parser: unknown format {name!r}; known: {', '.join(sorted(by_name))}")
    return by_name[name]


class AnswerParser:
    """A chat answer's text -> Deltas of reasoning, content and tool calls (tool calls
    only when the request offered tools: ``tool_format`` is then not None; ``schemas``
    are the offered tools' parameter schemas)."""

    def __init__(self, starts_thinking: bool, tool_format: ToolFormat | None, schemas: Schemas | None = None,
                 reasoning: ReasoningFormat = ReasoningFormat.THINK):
        harmony = reasoning == ReasoningFormat.HARMONY or tool_format == ToolFormat.HARMONY
        self.harmony = HarmonyParser(calls=tool_format == ToolFormat.HARMONY) if harmony else None
        self.reasoning = ReasoningSplitter(starts_thinking) if reasoning == ReasoningFormat.THINK else None
        self.tools = ToolCallParser(tool_format, schemas) if tool_format in SYNTAX else None

    def feed(self, text: str) -> Delta:
        if self.harmony is not None:
            return self.harmony.feed(text)
        reasoning, answer = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._answer(reasoning, answer, finishing=False)

    def finish(self) -> Delta:
        if self.harmony is not None:
            return self.harmony.finish()
        reasoning, answer = self.reasoning.finish() if self.reasoning else ("", "")
        return self._answer(reasoning, answer, finishing=True)

    def _answer(self, reasoning: str, answer: str, finishing: bool) -> Delta:
        if self.tools is None:
            return Delta(content=answer, reasoning=reasoning)
        delta = Delta(reasoning=reasoning)
        delta += self.tools.feed(answer)
        if finishing:
            delta += self.tools.finish()
        return delta


__all__ = ["AnswerParser", "Delta", "ParsedToolCall", "ToolFormat", "ReasoningFormat", "tool_format_of",
           "reasoning_format_of", "reasoning_format_named", "prompt_opens_thinking"]
