"""The chat REPL's slash commands, in the style of Ollama (``/set temp 0.7``, ``/bye``).

Each command is a small function ``(session, argument) -> text to show``; ``run_command``
finds it in one table. A wrong command or value raises ``UserError`` with a one-line hint,
which the REPL prints before asking again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import UserError
from .conversation import SETTING_RULES, ChatSession

MULTILINE_MARK = '"""'  # a line starting with it begins a message of several lines


class Quit(Exception):
    """Raised by /bye and /exit: the REPL ends."""


@dataclass(frozen=True)
class Command:
    usage: str
    help: str
    run: Callable[[ChatSession, str], str]


def _help(session: ChatSession, argument: str) -> str:
    width = max(len(c.usage) for c in COMMANDS.values())
    lines = [f"  {c.usage.ljust(width)}  {c.help}" for c in COMMANDS.values()]
    return "\n".join(
        ["Commands:", *lines,
         f"  {MULTILINE_MARK.ljust(width)}  begin and end a message of several lines",
         "Ctrl-C stops an answer or clears the line; Ctrl-D, /bye or Ctrl-C twice at an empty prompt leaves."]
    )


def _clear(session: ChatSession, argument: str) -> str:
    if argument not in ("", "system"):
        raise UserError("usage: /clear, or /clear system to drop the system prompt too")
    session.clear(system_prompt_too=argument == "system")
    kept = " (the system prompt is kept)" if session.conversation.system else ""
    return f"Started a new conversation{kept}."


def _system(session: ChatSession, argument: str) -> str:
    if not argument:
        return f"System prompt: {session.conversation.system}" if session.conversation.system else "No system prompt."
    session.conversation.system = argument
    return "Set the system prompt."


def _set(session: ChatSession, argument: str) -> str:
    name, _, value = argument.partition(" ")
    if name == "system":
        return _system(session, value.strip())
    if not name or not value.strip():
        raise UserError(f"usage: /set PARAMETER VALUE, where PARAMETER is one of {', '.join(SETTING_RULES)}")
    value = session.set(name, value.strip())
    return f"Set {name} to {value}."


def _show(session: ChatSession, argument: str) -> str:
    template = "the model's own" if session.tokenizer.has_chat_template else "the plain User:/Assistant: fallback"
    system = session.conversation.system or "(none)"
    return "\n".join(
        [
            f"model: {session.model_name}",
            f"parameters: {session.describe_settings()}",
            f"system prompt: {system}",
            f"chat template: {template}",
            f"context: {session.context_used()} of {session.context_limit} tokens used",
        ]
    )


def _stats(session: ChatSession, argument: str) -> str:
    stats = session.last_stats
    if stats is None:
        return "No answer yet."
    return "\n".join(
        [
            f"prompt: {stats.new_prompt_tokens} new tokens, {stats.prompt_tps:.1f} tok/s "
            f"(first token after {stats.first_token_s:.3f} s)",
            f"answer: {stats.generation_tokens} tokens, {stats.generation_tps:.1f} tok/s",
            f"conversation: {stats.conversation_tokens} tokens",
            *([f"speculative: {stats.accepted_tokens} of {stats.drafted_tokens} drafted tokens accepted"]
              if stats.drafted_tokens else []),
            f"peak memory: {stats.peak_memory_gb:.3f} GB",
        ]
    )


def _needs_file(argument: str, command: str) -> str:
    if not argument:
        raise UserError(f"usage: /{command} FILE")
    return argument


def _save(session: ChatSession, argument: str) -> str:
    path = _needs_file(argument, "save")
    written = session.save(path)
    return f"Saved the conversation ({written} messages) to {path}."


def _load(session: ChatSession, argument: str) -> str:
    path = _needs_file(argument, "load")
    n_tokens = session.load(path)
    system = " and the system prompt" if session.conversation.system else ""
    return (f"Loaded {len(session.conversation.turns)} messages{system} from {path} "
            f"({n_tokens} tokens in the cache).")


def _image(session: ChatSession, argument: str) -> str:
    path = _needs_file(argument, "image")
    count = session.attach_image(path)
    return f"Attached {path} to the next message ({count} image(s) so far)."


def _undo(session: ChatSession, argument: str) -> str:
    return "Dropped the last exchange." if session.undo() else "Nothing to undo."


def _bye(session: ChatSession, argument: str) -> str:
    raise Quit


COMMANDS: dict[str, Command] = {
    "help": Command("/help", "show this help", _help),
    "clear": Command("/clear [system]", "start a new conversation (keeps the system prompt unless 'system')", _clear),
    "system": Command("/system TEXT", "set the system prompt (alone: show it)", _system),
    "set": Command("/set NAME VALUE", f"set {', '.join(SETTING_RULES)} (or system)", _set),
    "show": Command("/show", "show the model, parameters and context used", _show),
    "stats": Command("/stats", "speed and memory of the last answer", _stats),
    "save": Command("/save FILE", "save the conversation as JSON", _save),
    "load": Command("/load FILE", "load a saved conversation (rebuilds the cache)", _load),
    "image": Command("/image FILE", "attach an image to the next message (several allowed)", _image),
    "undo": Command("/undo", "drop the last exchange", _undo),
    "bye": Command("/bye", "leave (also /exit)", _bye),
}
ALIASES = {"?": "help", "exit": "bye", "quit": "bye"}


def run_command(session: ChatSession, line: str) -> str:
    """Run one ``/command argument`` line; returns the text to show, raises ``Quit``."""
    name, _, argument = line.strip()[1:].partition(" ")
    name = ALIASES.get(name.lower(), name.lower())
    if name not in COMMANDS:
        raise UserError(f"unknown command /{name}; type /help for the list")
    return COMMANDS[name].run(session, argument.strip())


__all__ = ["run_command", "COMMANDS", "Quit"]
