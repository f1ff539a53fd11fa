"""A conversation with a model whose KV cache is kept between turns.

Each turn the whole conversation is rendered with the chat template and tokenized. The
session remembers exactly which token ids its cache holds (a ``TokenCache``); the new
rendering is compared with them, the cache is trimmed back to the common prefix (usually
all of it) and only the rest is fed to the model. So the time to the first token of turn
10 is about that of turn 1, and the prompt the model sees is always exactly what the
template renders (a partial, interrupted answer included).

After every answer the bookkeeping is reconciled with the cache itself: the generator may
have fed one token more than it yielded (or one fewer), so the cache is trimmed to the
tokens the session knows, and anything it lacks is fed at the next turn.

Context policy: the context holds ``min(max_position_embeddings, --max-kv-size)`` tokens.
When the prompt plus room for an answer (``max_tokens``, at most half the context) would
not fit, the oldest exchanges (a user message and its answer) are dropped, the system
prompt always kept, until the prompt takes at most half of what is left; the cache is
then rebuilt from the first token that changed (once every few turns, not every turn).
An answer that reaches the end of the context stops there with a notice. A single
message too long for the context is refused with a notice.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..atomic import atomic_file
from ..errors import UserError
from ..generation.text_to_text import check_decoder
from ..generation.token_cache import TokenCache
from ..jsonfile import read_json
from .images import ChatImages, refuse_with_draft

# -- sampling settings (the /set parameters) --------------------------------------------


@dataclass
class Settings:
    """The parameters ``/set`` changes; defaults as in ``mlx_lm.chat``."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    seed: int = 0


# name -> (type, is valid, what a valid value looks like)
SETTING_RULES: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "temp": (float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (float, lambda v: 0 < v <= 1, "a number in (0, 1] (1 = off)"),
    "top_k": (int, lambda v: v >= 0, "a whole number >= 0 (0 = off)"),
    "min_p": (float, lambda v: 0 <= v < 1, "a number in [0, 1) (0 = off)"),
    "max_tokens": (int, lambda v: v >= 1, "a whole number >= 1"),
    "seed": (int, lambda v: v >= 0, "a whole number >= 0"),
}


def parse_setting(name: str, text: str) -> float | int:
    """The value of ``/set name text``, or a UserError saying what would be valid."""
    if name not in SETTING_RULES:
        raise UserError(f"unknown parameter {name!r}; one of: {', '.join(SETTING_RULES)}")
    kind, is_valid, expected = SETTING_RULES[name]
    try:
        value = kind(text)
    except ValueError:
        raise UserError(f"{name} must be {expected}, not {text!r}") from None
    if not is_valid(value):
        raise UserError(f"{name} must be {expected}, not {text!r}")
    return value


def check_settings(settings: Settings) -> None:
    """Command-line values go through the same rules as ``/set``."""
    for name in SETTING_RULES:
        parse_setting(name, str(getattr(settings, name)))


# -- the conversation (messages only) --------------------------------------------------


@dataclass
class Conversation:
    """The system prompt and the alternating user/assistant messages."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def undo(self) -> bool:
        """Drop the last exchange (the last user message and its answer, if any)."""
        if not self.turns:
            return False
        if self.turns[-1]["role"] == "assistant":
            self.turns.pop()
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()
        return True

    def drop_oldest_exchange(self) -> bool:
        """Forget the first user message and its answer; the last exchange (or a new
        message after it) always stays."""
        if len(self.turns) <= 2:
            return False
        del self.turns[: 2 if self.turns[1]["role"] == "assistant" else 1]
        return True


def save_conversation(path: str | Path, conversation: Conversation, model: str) -> int:
    """Write ``{"model": ..., "messages": [...]}`` (the system prompt first, as a message):
    the same ``messages`` list chat-format training data uses. Returns how many messages
    were written. The folder must exist: a mistyped one is refused, not created."""
    path = Path(path).expanduser()
    if not path.parent.is_dir():
        raise UserError(f"cannot save to {path}: the folder {path.parent} does not exist")
    messages = conversation.messages()
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps({"model": model, "messages": messages}, indent=2, ensure_ascii=False) + "\n",
                       encoding="utf-8")
    return len(messages)


def load_conversation(path: str | Path) -> Conversation:
    """Read a file written by ``save_conversation`` (or any ``{"messages": [...]}``)."""
    path = Path(path).expanduser()
    data = read_json(path, expect=None, missing=f"cannot load {path}: no such file")
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        raise UserError(f"{path} is not a saved conversation: expected {{\"messages\": [...]}}")
    return conversation_from_messages(messages, str(path))


def conversation_from_messages(messages: list, source: str) -> Conversation:
    conversation = Conversation()
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)):
            raise UserError(f"{source}: message {i + 1} needs a text \"content\"")
        role = message.get("role")
        expected = "user" if not conversation.turns or conversation.turns[-1]["role"] == "assistant" else "assistant"
        if role == "system" and i == 0:
            conversation.system = message["content"]
        elif role == expected:
            images = message.get("images") if role == "user" else None  # paths, as /save writes them
            if images is not None and not (isinstance(images, list) and all(isinstance(p, str) for p in images)):
                raise UserError(f"{source}: message {i + 1} needs \"images\" as a list of file paths")
            turn = {"role": role, "content": message["content"]}
            conversation.turns.append({**turn, "images": images} if images else turn)
        else:
            raise UserError(f"{source}: message {i + 1} has role {role!r}, expected {expected!r}")
    if conversation.turns and conversation.turns[-1]["role"] != "assistant":
        raise UserError(f"{source}: the last message must be the assistant's answer")
    return conversation


# -- the session: conversation + cache --------------------------------------------------


@dataclass
class AnswerStats:
    """What ``/stats`` shows about the last answer."""

    new_prompt_tokens: int  # tokens fed to the model for this turn's prompt
    conversation_tokens: int  # the whole rendered conversation, the answer included
    prompt_tps: float
    first_token_s: float  # from the message to the first answer token
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None
    drafted_tokens: int = 0  # speculative decoding: guesses made
    accepted_tokens: int = 0  # ... and kept


class ChatSession:
    """A model, its tokenizer, a conversation and the KV cache that holds it.

    ``cache`` (a ``TokenCache``) holds the conversation: its ``tokens`` are always exactly
    the ids its layer caches hold, in order. ``kv_quantization`` quantizes it; a
    ``draft_model`` (with a ``TokenCache`` of its own, ``draft_cache``) or
    ``prompt_lookup_num_tokens`` decode speculatively (``mlx_tfm.generation.speculative``).
    """

    def __init__(self, model, tokenizer, settings: Settings | None = None, system_prompt: str | None = None,
                 max_kv_size: int | None = None, model_name: str = "", on_notice: Callable[[str], None] = print,
                 kv_quantization=None, draft_model=None, num_draft_tokens: int = 3, prompt_lookup_num_tokens: int = 0):
        check_decoder(model, "chat")
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings or Settings()
        self.conversation = Conversation(system=system_prompt or None)
        self.max_kv_size = max_kv_size
        self.model_name = model_name
        self.on_notice = on_notice
        bounds = [model.args.max_position_embeddings] + ([max_kv_size] if max_kv_size else [])
        self.context_limit = min(bounds)
        self.last_stats: AnswerStats | None = None
        self.cache = TokenCache(model, max_kv_size=max_kv_size, kv_quantization=kv_quantization, chunk_bound=True)
        self.draft_cache = TokenCache(draft_model) if draft_model is not None else None
        self.speculation = dict(num_draft_tokens=num_draft_tokens, prompt_lookup_num_tokens=prompt_lookup_num_tokens)
        self.images = ChatImages(model, tokenizer)  # /image: attached to the next message

    # -- settings ---------------------------------------------------------------------
    def set(self, name: str, text: str) -> float | int:
        value = parse_setting(name, text)
        setattr(self.settings, name, value)
        if name == "seed":
            import mlx.core as mx

            mx.random.seed(value)
        return value

    # -- rendering and the cache ------------------------------------------------------
    def attach_image(self, path: str) -> int:
        """Attach the image at ``path`` to the next message (read and encoded now); returns
        how many are attached."""
        refuse_with_draft(self.draft_cache)
        self.images.attach(path)
        return len(self.images.pending)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if ChatImages.of(messages):  # each image's tokens written out in its message
            return self.images.render(messages, add_generation_prompt)
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))

    def context_used(self) -> int:
        """Tokens the conversation takes in the context (rendered without a new prompt)."""
        return len(self.render(self.conversation.messages(), add_generation_prompt=False))

    def reset_cache(self) -> None:
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()

    def prefill(self, tokens: list[int]) -> None:
        """Feed ``tokens`` into the cache without generating (for ``/load``)."""
        import mlx.core as mx

        from ..generation.step import prefill

        model = self.images.bound(self.conversation.messages(), tokens)  # its image tokens get their features
        prefill(model, mx.array(tokens, dtype=mx.int32), self.cache.layers)
        self.cache.record(self.images.keys(self.conversation.messages(), tokens))

    def rebuild_cache(self) -> int:
        """Re-process the whole conversation into a fresh cache; returns its length."""
        self.reset_cache()
        self.conversation = self.images.with_digests(self.conversation)  # a loaded one's images read again
        self._drop_to_fit(self.render(self.conversation.messages()))
        tokens = self.render(self.conversation.messages(), add_generation_prompt=False)
        self.prefill(tokens[: self.context_limit])
        return len(self.cache.tokens)

    # -- the context policy -----------------------------------------------------------
    def _reserve(self) -> int:
        return min(self.settings.max_tokens, self.context_limit // 2)

    def _drop_to_fit(self, target: list[int]) -> list[int]:
        """When the prompt and room for an answer overflow the context, drop the oldest
        exchanges until the prompt takes at most half of the rest: dropping changes the
        start of the conversation, so the cache is rebuilt, and this way that happens
        once every few turns rather than every turn."""
        room = self.context_limit - self._reserve()
        if len(target) <= room:
            return target
        dropped = 0
        while len(target) > room // 2 and self.conversation.drop_oldest_exchange():
            dropped += 1
            target = self.render(self.conversation.messages())
        if dropped:
            self.on_notice(
                f"context full ({self.context_limit} tokens): dropped the {dropped} oldest exchange(s); "
                "the system prompt is kept"
            )
        return target

    def _prompt_for_new_message(self) -> list[int]:
        """The prompt for the message just added, after making room for it."""
        alone = Conversation(self.conversation.system, self.conversation.turns[-1:]).messages()
        if len(self.render(alone)) >= self.context_limit:
            raise UserError(
                f"message too long: with the system prompt it takes {len(self.render(alone))} tokens "
                f"and the context holds {self.context_limit}"
            )
        return self._drop_to_fit(self.render(self.conversation.messages()))

    # -- one turn ---------------------------------------------------------------------
    def answer(self, message: str, should_stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Add the user's ``message`` and stream the answer's text. ``should_stop`` is
        asked after every token; when it says yes the answer ends there and what was
        said so far is kept."""
        from ..generation.sampling import make_sampler
        from ..generation.stream import stream_generate

        start = time.perf_counter()
        images = self.images.take_pending()
        self.conversation.turns.append({"role": "user", "content": message, **({"images": images} if images else {})})
        try:
            target = self._prompt_for_new_message()
        except UserError:  # too long, or refused by the template: the message is not kept, its images wait
            self.conversation.turns.pop()
            self.images.pending = images
            raise
        keys = self.images.keys(self.conversation.messages(), target)  # images: by their content, not their ids
        feed = target[len(target) - len(self.cache.prepare(keys)):]
        new_prompt_tokens = len(feed)
        if keys is target:  # recurrent layers: a state to come back to (/undo); not read with images
            feed = self.cache.feed_to_snapshot(feed)
        budget = min(self.settings.max_tokens, self.context_limit - len(target))
        s = self.settings
        sampler = make_sampler(temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)
        model = self.images.bound(self.conversation.messages(), target)  # the image tokens fed get their features
        stream = stream_generate(model, self.tokenizer, feed, max_tokens=budget, sampler=sampler,
                                 prompt_cache=self.cache.layers, **self._speculation())
        tokens: list[int] = []
        first_token_s, last = 0.0, None
        try:
            for response in stream:
                first_token_s = first_token_s or time.perf_counter() - start
                tokens.append(response.token)
                last = response
                yield response.text
                if should_stop():
                    break
        finally:
            stream.close()
            self._finish_answer(keys, tokens)
        if last is not None:
            self._record_stats(last, new_prompt_tokens, len(target) + len(tokens), first_token_s)
            if last.finish_reason == "length" and budget < self.settings.max_tokens:
                self.on_notice(f"context full: the answer stopped at the end of the context ({self.context_limit} tokens)")

    def _speculation(self) -> dict:
        """``stream_generate``'s speculative settings, the draft's cache holding what ours does."""
        if self.draft_cache is None:
            return self.speculation
        from ..generation.speculative import sync_draft_cache

        sync_draft_cache(self.draft_cache, self.cache)
        return {**self.speculation, "draft_model": self.draft_cache.model, "draft_cache": self.draft_cache.layers}

    def _finish_answer(self, target: list[int], tokens: list[int]) -> None:
        """Keep the answer (also a stopped one) and make the bookkeeping match the cache."""
        answer_ids = [t for t in tokens if t not in self.tokenizer.eos_token_ids]
        self.conversation.turns.append({"role": "assistant", "content": self.tokenizer.decode(answer_ids)})
        self.cache.reconcile(target + tokens)
        self.cache.snapshot()  # recurrent layers: the next turn starts from here, /undo from the turn before
        if self.draft_cache is not None:
            self.draft_cache.reconcile(target + tokens)
            self.draft_cache.snapshot()

    def _record_stats(self, last, new_prompt_tokens: int, conversation_tokens: int, first_token_s: float) -> None:
        self.last_stats = AnswerStats(
            new_prompt_tokens=new_prompt_tokens,
            conversation_tokens=conversation_tokens,
            prompt_tps=last.prompt_tps,
            first_token_s=first_token_s,
            generation_tokens=last.generation_tokens,
            generation_tps=last.generation_tps,
            peak_memory_gb=last.peak_memory,
            finish_reason=last.finish_reason,
            drafted_tokens=last.drafted_tokens,
            accepted_tokens=last.accepted_tokens,
        )

    # -- whole-conversation operations -------------------------------------------------
    def clear(self, system_prompt_too: bool = False) -> None:
        """A new conversation; the system prompt stays unless asked otherwise."""
        self.conversation.turns.clear()
        self.images.pending = []
        if system_prompt_too:
            self.conversation.system = None
        self.reset_cache()

    def undo(self) -> bool:
        """Drop the last exchange; the cache is trimmed at the next turn."""
        return self.conversation.undo()

    def save(self, path: str | Path) -> int:
        """Save the conversation (``save_conversation``); returns how many messages were written."""
        return save_conversation(path, self.images.with_paths(self.conversation), self.model_name)

    def load(self, path: str | Path) -> int:
        """Replace the conversation with a saved one and rebuild the cache for it."""
        conversation = self.images.with_digests(load_conversation(path))  # an image gone: nothing changes
        self.conversation = conversation
        return self.rebuild_cache()

    def describe_settings(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(self.settings).items())


__all__ = ["ChatSession", "Conversation", "Settings", "AnswerStats", "parse_setting", "save_conversation",
           "load_conversation"]
