"""Training data: a tokenizer for pre-training (a byte-level one when there is no
vocabulary), text corpora as one token stream, and batches.

Pre-training reads a ``.txt`` file or a jsonl folder (``mlx_tfm.datasets``) and trains on
random windows of one long token stream. Batches are a pure function of ``(seed, step)``,
so a resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..datasets import Example, load_split
from ..errors import UserError

# -- a byte-level tokenizer for pre-training without a vocabulary --------------------


class ByteTokenizer:
    """Bytes 0..255 are ids 0..255; BOS is 256, EOS is 257. Nothing to train, nothing unknown.

    ``save`` writes it as a Hugging Face ``tokenizer.json`` (a byte-level BPE without merges)
    so a trained model folder loads with the ordinary tokenizer loader.
    """

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    has_chat_template = False

    @property
    def eos_token_ids(self) -> set[int]:
        return {self.eos_token_id}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def files(self) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json, name -> bytes."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

        from ..tokenizer.detokenizer import byte_level_alphabet

        # ByteLevel maps each byte to a printable character; id = the byte's value.
        alphabet = byte_level_alphabet()  # {printable character: byte}
        tokenizer = Tokenizer(models.BPE(vocab=alphabet, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(["<s>", "</s>"])
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
        config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}
        return {"tokenizer.json": tokenizer.to_str().encode(), "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}

    def save(self, folder: Path) -> None:
        for name, data in self.files().items():
            (Path(folder) / name).write_bytes(data)


def tokenizer_folder(spec: str) -> Path:
    """The folder a tokenizer spec names (a tokenizer file stands for its folder)."""
    folder = Path(spec).expanduser()
    return folder.parent if folder.is_file() else folder


def load_training_tokenizer(spec: str):
    """``"byte"`` or a folder with tokenizer.model / tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    from ..tokenizer import load_tokenizer

    folder = tokenizer_folder(spec)
    if not folder.is_dir():
        raise UserError(f"tokenizer {spec!r} is neither 'byte' nor a folder with tokenizer.model / tokenizer.json")
    return load_tokenizer(folder)


# -- batches --------------------------------------------------------------------------


@dataclass
class Batch:
    tokens: np.ndarray  # (B, T) int32, zero-padded
    lengths: np.ndarray  # (B, 2) int32: (prompt_length, length)
    pixel_values: np.ndarray | None = None  # (n_views, C, H, W): the rows' images (image_data.py)
    tower_inputs: dict | None = None  # the tower's other inputs, a row per view (image_data.py)


def pad_batch(examples: list[Example], pad_to: int = 8) -> Batch:
    """Right-pad to the longest example, rounded up to ``pad_to`` positions of input
    (fewer distinct shapes means fewer recompilations of the training step)."""
    longest = max(len(tokens) for tokens, _ in examples)
    width = 1 + pad_to * -(-(longest - 1) // pad_to)
    tokens = np.zeros((len(examples), width), np.int32)
    for row, (ids, _) in enumerate(examples):
        tokens[row, : len(ids)] = ids
    lengths = np.array([(prompt, len(ids)) for ids, prompt in examples], np.int32)
    return Batch(tokens, lengths)


class LengthGroupedBatches:
    """Examples sorted by length and cut into batches of similar length; each epoch visits
    the batches in a fresh order drawn from ``(seed, epoch)``. ``batch(step)`` is pure."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int = 0, pad_to: int = 8):
        if len(examples) < batch_size:
            raise UserError(f"the data set has {len(examples)} examples, fewer than the batch size {batch_size}")
        order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
        self.groups = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
        self.examples, self.seed, self.pad_to = examples, seed, pad_to

    def __len__(self) -> int:
        return len(self.groups)

    def batch(self, step: int) -> Batch:
        epoch, position = divmod(step, len(self.groups))
        permutation = np.random.default_rng([self.seed, epoch]).permutation(len(self.groups))
        return self.collate([self.examples[i] for i in self.groups[permutation[position]]])

    def evaluation(self, max_batches: int = -1) -> list[Batch]:
        """Batches in a fixed order, ``max_batches <= 0`` meaning all of them."""
        count = len(self.groups) if max_batches <= 0 else min(max_batches, len(self.groups))
        return [self.collate([self.examples[i] for i in g]) for g in self.groups[:count]]

    def collate(self, examples: list) -> Batch:
        """One batch of examples (a subclass adds what its examples carry beside tokens)."""
        return pad_batch(examples, self.pad_to)


class TokenWindows:
    """Random windows of ``seq_len + 1`` tokens from one token stream (pre-training)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        if len(tokens) <= seq_len + 1:
            raise UserError(f"the corpus has {len(tokens)} tokens, too few for sequences of {seq_len}")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed

    def _window_batch(self, starts) -> Batch:
        tokens = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)
        lengths = np.tile(np.array([[0, self.seq_len + 1]], np.int32), (len(starts), 1))
        return Batch(tokens, lengths)

    def batch(self, step: int) -> Batch:
        rng = np.random.default_rng([self.seed, step])
        return self._window_batch(rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch_size))

    def evaluation(self, max_batches: int = -1) -> list[Batch]:
        """Consecutive non-overlapping windows from the start of the stream."""
        starts = list(range(0, len(self.tokens) - self.seq_len - 1, self.seq_len))
        batches = [starts[i : i + self.batch_size] for i in range(0, len(starts), self.batch_size)]
        batches = batches if max_batches <= 0 else batches[:max_batches]
        return [self._window_batch(b) for b in batches]


# -- pre-training corpora -------------------------------------------------------------


def load_corpus(path: str | Path, tokenizer, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, validation tokens) from a .txt file (its last ``val_fraction`` is held
    out) or a folder of jsonl (train.jsonl, and valid.jsonl or a held-out tail)."""
    path = Path(path).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise UserError(f"corpus {path} is empty")
        cut = int(len(text) * (1 - val_fraction))
        train = tokenizer.encode(text[:cut])
        valid = tokenizer.encode(text[cut:])
        return np.array(train, np.int32), np.array(valid, np.int32)
    if path.is_dir():
        train = _stream(load_split(path, "train", tokenizer))
        if (path / "valid.jsonl").is_file():
            return train, _stream(load_split(path, "valid", tokenizer))
        cut = int(len(train) * (1 - val_fraction))
        return train[:cut], train[cut:]
    raise UserError(f"corpus {path} does not exist (give a .txt file or a folder with train.jsonl)")


def _stream(examples: list[Example]) -> np.ndarray:
    return np.concatenate([np.array(tokens, np.int32) for tokens, _ in examples])
