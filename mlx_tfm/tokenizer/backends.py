"""The two tokenizer backends: ``tokenizer.json`` through the Hugging Face ``tokenizers``
library (byte-level BPE as in GPT-2, Llama 3 and Qwen; SentencePiece-style
Metaspace/ByteFallback as in Llama 2 and Mistral; anything else the library knows), and
``tokenizer.model`` through ``sentencepiece`` (Llama 2, the llama2.c tiny models)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from ..errors import UserError
from .detokenizer import (
    SPIECE_UNDERLINE,
    LibraryStreamingDetokenizer,
    StreamingDetokenizer,
    byte_level_piece_bytes,
    sentencepiece_piece_bytes,
)

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


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
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise UserError(f"{path} is not a readable tokenizer.json ({e})") from None
        # The decoder's own JSON (its pickled state), not a second parse of the whole file:
        # a large vocabulary as Python objects would stay in the process's memory.
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else None
        self._setup(tokenizer, _decoder_kind(decoder), add_bos)

    @classmethod
    def from_wordpiece_vocab(cls, path: Path, lowercase: bool) -> "HFTokenizersBackend":
        """BERT's ``vocab.txt`` alone, built into the tokenizer.json it stands for: BERT's
        normaliser and pre-tokenizer, WordPiece, ``[CLS] text [SEP]`` (and ``[SEP] pair [SEP]``)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

        try:
            vocab = models.WordPiece.read_file(str(path))
        except Exception as e:
            raise UserError(f"{path} is not a readable WordPiece vocab.txt ({e})") from None
        missing = [t for t in BERT_SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise UserError(f"{path} lacks BERT's special token(s) {', '.join(missing)}")
        tokenizer = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"]))
        tokenizer.decoder = decoders.WordPiece()
        tokenizer.add_special_tokens(list(BERT_SPECIAL_TOKENS))
        backend = cls.__new__(cls)
        backend._setup(tokenizer, "other", None)
        return backend

    def _setup(self, tokenizer, decoder_kind: str, add_bos: bool | None) -> None:
        # A tokenizer.json may carry its own truncation and padding (sentence-transformers
        # folders do): encode() returns the whole text; encoders truncate on request.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.decoder_kind = decoder_kind
        self.add_bos = add_bos
        self.bos_id: int | None = None  # set by load_tokenizer once the BOS token is known
        self._truncating = threading.Lock()

    def encode_truncated(self, texts: list[str], pairs: list[str] | None, max_length: int | None
                         ) -> list[tuple[list[int], list[int], bool]]:
        """(ids, token type ids, whether it was cut) of each text (and its pair), special
        tokens added, cut to ``max_length`` tokens as transformers cuts (longest first)."""
        inputs = list(zip(texts, pairs)) if pairs is not None else list(texts)
        with self._truncating:
            if max_length is not None:
                self.tokenizer.enable_truncation(max_length, strategy="longest_first")
            try:
                encodings = self.tokenizer.encode_batch(inputs)
            finally:
                self.tokenizer.no_truncation()
        return [(e.ids, e.type_ids, bool(e.overflowing)) for e in encodings]

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
