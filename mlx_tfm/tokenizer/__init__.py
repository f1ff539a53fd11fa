"""Tokenizers: text <-> token ids, chat templates, and streaming detokenization.

``load_tokenizer(folder)`` reads ``tokenizer.json`` (``backends.HFTokenizersBackend``) or
``tokenizer.model`` (``backends.SentencePieceBackend``). Special tokens come from
``tokenizer_config.json``, ``generation_config.json`` and the model's ``config.json``
(passed in as ``eos_token_ids``). Chat templates: ``chat_template``; streaming text:
``detokenizer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from ..errors import UserError
from ..jsonfile import read_json
from .backends import HFTokenizersBackend, SentencePieceBackend
from .chat_template import FALLBACK_CHAT_TEMPLATE, render_chat_template
from .detokenizer import StreamingDetokenizer

# What a tokenizer (and generation) needs beside the weights: the files a model folder
# carries over when it is converted, fused or trained.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",  # T5, mT5
    "sentencepiece.bpe.model",  # XLM-R
    "vocab.txt",  # BERT's WordPiece
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",  # image-text models: images -> pixel values (tokenizer/images.py)
    "processor_config.json",  # ... and their place in the prompt (tokenizer/image_tokens.py)
)


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

    def encode_truncated(self, texts: list[str], pairs: list[str] | None = None, max_length: int | None = None
                         ) -> list[tuple[list[int], list[int], bool]]:
        """For encoders: (ids, token type ids, whether it was cut) of each text, or of each
        (text, pair) as a cross-encoder reads them (``[CLS] a [SEP] b [SEP]``), with special
        tokens, cut to ``max_length`` longest-first as transformers cuts."""
        if not isinstance(self._backend, HFTokenizersBackend):
            if pairs is not None:
                raise UserError("text pairs need a tokenizer.json tokenizer")
            encoded = [self.encode(text) for text in texts]
            return [(ids[:max_length] if max_length else ids, [0] * len(ids[:max_length] if max_length else ids),
                     bool(max_length) and len(ids) > max_length) for ids in encoded]
        return self._backend.encode_truncated(texts, pairs, max_length)

    def special_token_id(self, name: str) -> int | None:
        """The id of a special token by its tokenizer_config name ("mask_token", "pad_token"...)."""
        text = self.special_tokens.get(name)
        return None if text is None else self._backend.token_to_id(text)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token`` (as the vocabulary writes it), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id``, as the vocabulary spells it (special ones too)."""
        return self._backend.id_to_token(int(token_id))

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
        return self._backend.make_detokenizer(self.token_bytes(), at_start_of_text)

    def token_bytes(self) -> list[bytes] | None:
        """The bytes each token id stands for (b"" for control tokens such as BOS/EOS), as
        the streaming detokenizer joins them; None for tokenizer.json decoders whose pieces
        do not map to bytes one by one. Computed once."""
        if self._token_bytes is None:
            self._token_bytes = self._backend.token_bytes()
        return self._token_bytes

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


# -- loading ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    """An optional file of the folder: {} when it is not there."""
    return read_json(path) if path.is_file() else {}


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


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "cls_token", "sep_token")
# SentencePiece tokenizers that end every text with EOS and start none with BOS (transformers'
# T5Tokenizer); their tokenizer_config.json names the class but not add_eos_token.
EOS_ONLY_CLASSES = ("T5Tokenizer", "T5TokenizerFast", "MT5Tokenizer", "MT5TokenizerFast")


def _read_backend(folder: Path, config: dict, special: dict):
    """tokenizer.json; else a SentencePiece model (tokenizer.model, or T5's spiece.model);
    else BERT's WordPiece vocab.txt (its special tokens then default to BERT's)."""
    if (folder / "tokenizer.json").is_file():
        return HFTokenizersBackend(folder / "tokenizer.json", add_bos=config.get("add_bos_token"))
    eos_only = config.get("tokenizer_class") in EOS_ONLY_CLASSES
    for name in ("tokenizer.model", "spiece.model"):
        if (folder / name).is_file():
            return SentencePieceBackend(folder / name, add_bos=config.get("add_bos_token", not eos_only),
                                        add_eos=config.get("add_eos_token", eos_only))
    if (folder / "vocab.txt").is_file():
        for name, token in (("unk_token", "[UNK]"), ("pad_token", "[PAD]"), ("mask_token", "[MASK]"),
                            ("cls_token", "[CLS]"), ("sep_token", "[SEP]")):
            special[name] = special[name] or token
        return HFTokenizersBackend.from_wordpiece_vocab(folder / "vocab.txt", config.get("do_lower_case", True))
    raise UserError(f"{folder} has no tokenizer (tokenizer.json, tokenizer.model, spiece.model or vocab.txt)")


def load_tokenizer(folder: Path, eos_token_ids: int | list[int] | None = None) -> Tokenizer:
    """The tokenizer of a model folder: tokenizer.json if present, else tokenizer.model.

    ``eos_token_ids`` (from the model's config.json) are added to the EOS tokens named by
    generation_config.json and tokenizer_config.json.
    """
    folder = Path(folder)
    config = _read_json(folder / "tokenizer_config.json")
    special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    backend = _read_backend(folder, config, special)

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


__all__ = ["Tokenizer", "load_tokenizer", "FALLBACK_CHAT_TEMPLATE", "StreamingDetokenizer", "render_chat_template",
           "TOKENIZER_FILES"]
