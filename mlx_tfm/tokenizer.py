"""Tokenizers: text <-> token ids, chat templates, and streaming detokenization.

Two kinds of tokenizer files are read:

- ``tokenizer.json`` through the Hugging Face ``tokenizers`` library (byte-level BPE as in
  GPT-2, Llama 3 and Qwen; SentencePiece-style Metaspace/ByteFallback as in Llama 2 and
  Mistral; anything else the library knows);
- ``tokenizer.model`` through ``sentencepiece`` (Llama 2, the llama2.c tiny models).

Special tokens come from ``tokenizer_config.json``, ``generation_config.json`` and the
model's ``config.json`` (passed in as ``eos_token_ids``). Chat templates are rendered with
jinja2 in the same environment Hugging Face uses, so a model's template gives the same
prompt here as in ``transformers``.

The streaming detokenizer turns ids into text one token at a time and never emits half a
UTF-8 character: each token is mapped to the *bytes* it stands for (byte-fallback pieces
``<0xE4>`` are one byte, byte-level BPE pieces are their bytes), and the bytes go through an
incremental UTF-8 decoder that holds back an incomplete character until its last byte comes.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from .errors import UserError

# Used by the chat REPL (and `apply_chat_template`) for models that ship no template: plain
# "User:/Assistant:" turns, after the BOS token if the model has one. The system message,
# if any, comes first as a plain paragraph.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

SPIECE_UNDERLINE = "\u2581"  # "▁", SentencePiece's marker for a space
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


# -- streaming detokenizers ------------------------------------------------------------


class StreamingDetokenizer:
    """Text from token ids as they arrive, never splitting a UTF-8 character.

    ``add_token(id)`` feeds one token; ``last_segment`` returns the text completed since the
    last time it was read; ``text`` is everything so far; ``finalize()`` flushes what is
    held back (an incomplete character at the very end becomes U+FFFD).
    ``trim_leading_space`` drops the one space SentencePiece puts before the first word
    (``decode`` does the same), so streaming equals ``tokenizer.decode(ids)``.
    """

    def __init__(self, token_bytes: list[bytes], trim_leading_space: bool = False):
        self._token_bytes = token_bytes
        self._trim = trim_leading_space
        self.reset()

    def reset(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = self._trim
        self.text = ""
        self.tokens: list[int] = []
        self._read = 0

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        piece = self._token_bytes[token] if 0 <= token < len(self._token_bytes) else b""
        if self._at_start and piece:
            piece = piece[1:] if piece.startswith(b" ") else piece
            self._at_start = False
        self.text += self._decoder.decode(piece)

    def finalize(self) -> None:
        self.text += self._decoder.decode(b"", final=True)

    @property
    def last_segment(self) -> str:
        segment = self.text[self._read :]
        self._read = len(self.text)
        return segment


class LibraryStreamingDetokenizer:
    """The same interface over ``tokenizers.decoders.DecodeStream``, for tokenizer.json
    decoders whose pieces do not map to bytes one by one (WordPiece, suffix BPE...)."""

    def __init__(self, backend):
        self._backend = backend
        self.reset()

    def reset(self) -> None:
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=True)
        self.text = ""
        self.tokens: list[int] = []
        self._read = 0

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        piece = self._stream.step(self._backend, token)
        if piece:
            self.text += piece

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        segment = self.text[self._read :]
        self._read = len(self.text)
        return segment


# -- per-token bytes ---------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, 0x7F-0xA0,
    0xAD) are shifted to U+0100 onwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def byte_level_piece_bytes(piece: str) -> bytes:
    alphabet = byte_level_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return piece.encode("utf-8")  # an added token written as plain text


def sentencepiece_piece_bytes(piece: str) -> bytes:
    match = _BYTE_PIECE.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(SPIECE_UNDERLINE, " ").encode("utf-8")


# -- backends --------------------------------------------------------------------------


class SentencePieceBackend:
    """``tokenizer.model`` through the sentencepiece library."""

    def __init__(self, path: Path, add_bos: bool, add_eos: bool):
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:
            raise UserError(f"{path} is not a readable SentencePiece model ({e})") from None
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_id: int | None = self.default_bos()  # load_tokenizer may override it
        # Control tokens written as text ("<s>" in a rendered chat template) become their
        # ids, as in transformers; sentencepiece alone would spell them out letter by letter.
        controls = {self.sp.id_to_piece(i): i for i in range(self.vocab_size) if self.sp.is_control(i)}
        self._controls = controls
        self._control_pattern = re.compile("(" + "|".join(map(re.escape, controls)) + ")") if controls else None

    def _encode_text(self, text: str) -> list[int]:
        if self._control_pattern is None:
            return self.sp.encode(text)
        ids = []
        for i, part in enumerate(self._control_pattern.split(text)):
            if i % 2:
                ids.append(self._controls[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._encode_text(text)
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_special_tokens and self.add_eos and self.sp.eos_id() >= 0:
            ids = [*ids, self.sp.eos_id()]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        token_id = self.sp.piece_to_id(token)
        return None if token_id == self.sp.unk_id() and token != self.sp.id_to_piece(token_id) else token_id

    def id_to_token(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def default_bos(self) -> int | None:
        return self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def default_eos(self) -> int | None:
        return self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def make_detokenizer(self, token_bytes: list[bytes], at_start_of_text: bool):
        return StreamingDetokenizer(token_bytes, trim_leading_space=at_start_of_text)

    def token_bytes(self) -> list[bytes]:
        table = []
        for i in range(self.vocab_size):
            if self.sp.is_control(i):
                table.append(b"")
            elif self.sp.is_unknown(i):
                table.append(self.sp.decode([i]).encode("utf-8"))
            else:
                table.append(sentencepiece_piece_bytes(self.sp.id_to_piece(i)))
        return table


class HFTokenizersBackend:
    """``tokenizer.json`` through the Hugging Face tokenizers library."""

    def __init__(self, path: Path, add_bos: bool | None):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            text = path.read_text(encoding="utf-8")
            self.tokenizer = HFTokenizer.from_str(text)
        except Exception as e:
            raise UserError(f"{path} is not a readable tokenizer.json ({e})") from None
        self.decoder_kind = _decoder_kind(json.loads(text).get("decoder"))
        self.add_bos = add_bos
        self.bos_id: int | None = None  # set by load_tokenizer once the BOS token is known

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        # Some tokenizer.json files lack the post-processor that tokenizer_config asks for.
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def default_bos(self) -> int | None:
        return None

    def default_eos(self) -> int | None:
        return None

    def make_detokenizer(self, token_bytes: list[bytes] | None, at_start_of_text: bool):
        if self.decoder_kind == "other":
            return LibraryStreamingDetokenizer(self.tokenizer)
        trim = at_start_of_text and self.decoder_kind == "metaspace-strip"
        return StreamingDetokenizer(token_bytes, trim_leading_space=trim)

    def token_bytes(self) -> list[bytes] | None:
        if self.decoder_kind == "other":
            return None
        to_bytes = byte_level_piece_bytes if self.decoder_kind == "byte-level" else sentencepiece_piece_bytes
        table = [b""] * self.vocab_size
        for piece, i in self.tokenizer.get_vocab(with_added_tokens=False).items():
            table[i] = to_bytes(piece)
        for i, added in self.tokenizer.get_added_tokens_decoder().items():
            table[i] = b"" if added.special else added.content.encode("utf-8")
        return table


def _decoder_kind(decoder: dict | None) -> str:
    """How token pieces become bytes: "byte-level", "metaspace" (▁ = space, <0x..> = a
    byte), "metaspace-strip" (and the first leading space is dropped), or "other"."""
    if not decoder:
        return "other"
    kinds = [d["type"] for d in decoder.get("decoders", [])] if decoder["type"] == "Sequence" else [decoder["type"]]
    if kinds == ["ByteLevel"]:
        return "byte-level"
    if decoder["type"] == "Metaspace":
        return "metaspace-strip" if decoder.get("prepend_scheme", "always") != "never" else "metaspace"
    replaces_space = any(
        d["type"] == "Replace" and d.get("content") == " " and d.get("pattern", {}).get("String") == SPIECE_UNDERLINE
        for d in decoder.get("decoders", [])
    )
    if replaces_space and set(kinds) <= {"Replace", "ByteFallback", "Fuse", "Strip"}:
        return "metaspace-strip" if "Strip" in kinds else "metaspace"
    return "other"


# -- the tokenizer ---------------------------------------------------------------------


class Tokenizer:
    """Encode, decode, stream-decode and render chat templates for one model.

    Attributes: ``bos_token_id`` (or None), ``eos_token_ids`` (a set: generation stops on
    any), ``vocab_size``, ``chat_template`` (the model's own, or None).
    """

    def __init__(self, backend, bos_token_id: int | None, eos_token_ids: set[int], special_tokens: dict[str, str | None],
                 chat_template: str | None):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.special_tokens = special_tokens  # bos_token, eos_token, unk_token, pad_token as text
        self.chat_template = chat_template
        self._token_bytes: list[bytes] | None = None

    # encoding and decoding
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (BOS, EOS...) are skipped."""
        return self._backend.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return min(self.eos_token_ids) if self.eos_token_ids else None

    @property
    def detokenizer(self):
        """A fresh streaming detokenizer (see ``StreamingDetokenizer``); its text equals
        ``decode(ids)`` of the ids fed to it."""
        return self.make_detokenizer(at_start_of_text=True)

    def make_detokenizer(self, at_start_of_text: bool = True):
        """A fresh streaming detokenizer. ``at_start_of_text=False`` continues text that
        is already there (a prompt): SentencePiece's leading space before the first word
        is then kept (" there" after "Once upon a time"), not trimmed as ``decode`` does."""
        if self._token_bytes is None:
            self._token_bytes = self._backend.token_bytes()
        return self._backend.make_detokenizer(self._token_bytes, at_start_of_text)

    # chat
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True, chat_template: str | None = None, **extra) -> list[int] | str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's template
        (or ``chat_template``, or ``FALLBACK_CHAT_TEMPLATE``) the way transformers does.
        The template writes BOS itself, so tokens are encoded without adding specials."""
        template = chat_template or self.chat_template or FALLBACK_CHAT_TEMPLATE
        text = render_chat_template(template, messages, add_generation_prompt, **self.special_tokens, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text


# -- chat templates, rendered as transformers renders them -----------------------------


@functools.lru_cache(maxsize=8)
def _compile_template(template: str):
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError, TemplateSyntaxError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise UserError(f"the chat template is not valid jinja2: {e}") from None


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         **variables) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return _compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError as e:
        raise UserError(f"the chat template refused these messages: {e}") from None


# -- loading ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def _token_text(value) -> str | None:
    """tokenizer_config writes a special token as text or as {"content": text, ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _read_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    if template:
        return template
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return _read_json(folder / "chat_template.json").get("chat_template")


def load_tokenizer(folder: Path, eos_token_ids: int | list[int] | None = None) -> Tokenizer:
    """The tokenizer of a model folder: tokenizer.json if present, else tokenizer.model.

    ``eos_token_ids`` (from the model's config.json) are added to the EOS tokens named by
    generation_config.json and tokenizer_config.json.
    """
    folder = Path(folder)
    config = _read_json(folder / "tokenizer_config.json")
    special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    if (folder / "tokenizer.json").is_file():
        backend = HFTokenizersBackend(folder / "tokenizer.json", add_bos=config.get("add_bos_token"))
    elif (folder / "tokenizer.model").is_file():
        backend = SentencePieceBackend(
            folder / "tokenizer.model", add_bos=config.get("add_bos_token", True), add_eos=config.get("add_eos_token", False)
        )
    else:
        raise UserError(f"{folder} has no tokenizer (tokenizer.json or tokenizer.model)")

    def token_id(name: str) -> int | None:
        return backend.token_to_id(special[name]) if special[name] else None

    bos = token_id("bos_token")
    bos = bos if bos is not None else backend.default_bos()
    backend.bos_id = bos
    generation_config = _read_json(folder / "generation_config.json")
    eos = _as_id_set(eos_token_ids) | _as_id_set(generation_config.get("eos_token_id"))
    for candidate in (token_id("eos_token"), backend.default_eos()):
        if candidate is not None:
            eos.add(candidate)
    # The template's bos_token/eos_token variables: the texts of the ids we settled on.
    if special["bos_token"] is None and bos is not None:
        special["bos_token"] = backend.id_to_token(bos)
    if special["eos_token"] is None and eos:
        special["eos_token"] = backend.id_to_token(min(eos))
    return Tokenizer(backend, bos, eos, special, _read_chat_template(folder, config))


__all__ = ["Tokenizer", "load_tokenizer", "FALLBACK_CHAT_TEMPLATE", "StreamingDetokenizer", "render_chat_template"]
