"""Streaming detokenization: text from token ids as they arrive, never half a UTF-8 character.

Each token is mapped to the *bytes* it stands for (byte-fallback pieces ``<0xE4>`` are one
byte, byte-level BPE pieces are their bytes), and the bytes go through an incremental UTF-8
decoder that holds back an incomplete character until its last byte comes.
"""

from __future__ import annotations

import codecs
import functools
import re

SPIECE_UNDERLINE = "\u2581"  # "▁", SentencePiece's marker for a space
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


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
