"""The encoders' other two jobs beside embeddings: ``rerank`` (a cross-encoder scores each
query-document pair as sentence-transformers' ``CrossEncoder.predict`` does) and
``fill_mask`` (the masked-LM head's guesses for each mask token, as transformers'
fill-mask pipeline gives them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from ..errors import UserError
from .embeddings import (
    DENSE_ACTIVATIONS,
    batches,
    check_encoder,
    max_tokens,
    sentence_modules,
    tokenize,
)


@dataclass(frozen=True)
class Ranked:
    index: int  # the document's place in the input
    score: float
    document: str


def rerank_scores(model, tokenizer, query: str, documents: list[str], batch_size: int = 32,
                  notify: Callable[[str], None] | None = None) -> np.ndarray:
    """One relevance score per document (the single class logit through the model's
    activation, sigmoid by default), pairs cut longest-first to the model's max length."""
    check_encoder(model, "reranking")
    if model.args.head != "classification" or model.args.num_labels != 1:
        raise UserError("reranking needs a cross-encoder (a sequence-classification model with one label); "
                        f"this {model.args.model_type} has head {model.args.head!r}")
    if not documents:
        raise UserError("give at least one document to rank")
    modules = sentence_modules(model)
    encoded = tokenize(tokenizer, [query] * len(documents), list(documents), max_tokens(model, modules), notify)
    scores = np.zeros(len(documents), np.float32)
    pad_id = tokenizer.special_token_id("pad_token") or 0
    activation = DENSE_ACTIVATIONS[modules.score_activation]
    for rows, ids, types, mask in batches(encoded, batch_size, pad_id):
        logits = model(ids, types if model.args.type_vocab_size > 1 else None, mask)[:, 0]
        scores[rows] = np.array(activation(logits.astype(mx.float32)))
    return scores


def rerank(model, tokenizer, query: str, documents: list[str], top_k: int | None = None, batch_size: int = 32,
           notify: Callable[[str], None] | None = None) -> list[Ranked]:
    """The documents from most to least relevant to ``query`` (the first ``top_k``)."""
    scores = rerank_scores(model, tokenizer, query, documents, batch_size, notify)
    order = np.argsort(-scores, kind="stable")[:top_k]
    return [Ranked(int(i), float(scores[i]), documents[i]) for i in order]


@dataclass(frozen=True)
class Guess:
    token: int
    token_str: str
    score: float  # probability
    sequence: str  # the text with this guess in place of the mask


def fill_mask(model, tokenizer, text: str, top_k: int = 5) -> list[list[Guess]]:
    """For each mask token in ``text`` (``[MASK]``, ``<mask>``... as the tokenizer names it),
    the ``top_k`` most probable tokens, by the softmax of the masked-LM logits there."""
    check_encoder(model, "fill-mask")
    if model.args.head != "masked_lm":
        raise UserError(f"fill-mask needs a masked-LM model; this {model.args.model_type} has head "
                        f"{model.args.head!r}")
    mask_token, mask_id = tokenizer.special_tokens.get("mask_token"), tokenizer.special_token_id("mask_token")
    if mask_id is None:
        raise UserError("the tokenizer has no mask token")
    if top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}")
    (ids, types), = tokenize(tokenizer, [text], None, max_tokens(model, sentence_modules(model)), None)
    positions = [i for i, t in enumerate(ids) if t == mask_id]
    if not positions:
        raise UserError(f"the text has no {mask_token} token to fill")
    logits = model(mx.array([ids]))[0].astype(mx.float32)  # (L, V)
    probs = np.array(mx.softmax(logits[mx.array(positions)], axis=-1))
    guesses = []
    for position, row in zip(positions, probs):
        best = np.argsort(-row, kind="stable")[:top_k]
        guesses.append([Guess(int(t), tokenizer.decode([int(t)]), float(row[t]),
                              tokenizer.decode([int(t) if i == position else x for i, x in enumerate(ids)]))
                        for t in best])
    return guesses


__all__ = ["rerank", "rerank_scores", "fill_mask", "Ranked", "Guess"]
