"""``encode(model, tokenizer, texts)``: sentence embeddings as sentence-transformers makes
them: the prompt before each text, each cut to ``max_seq_length`` tokens (with a notice),
texts sorted by length into batches (order restored), the encoder's hidden states pooled
(``mlx_tfm.model.heads.pool``), the Dense layers, then the dimensions truncated and the vectors
normalised (in that order: a truncated vector is renormalised).
"""

from __future__ import annotations

import warnings
from typing import Callable

import mlx.core as mx
import numpy as np

from ..errors import UserError
from ..model.heads import pool
from ..weights.sentence_modules import DenseLayer, SentenceModules, check_pooling

DENSE_ACTIVATIONS = {"tanh": mx.tanh, "identity": lambda x: x, "relu": lambda x: mx.maximum(x, 0),
                     "gelu": lambda x: x * (1 + mx.erf(x / 2**0.5)) / 2, "sigmoid": mx.sigmoid,
                     "silu": lambda x: x * mx.sigmoid(x)}


class EmbeddingNotice(UserWarning):
    """Something ``encode`` did that the caller may not expect: texts cut to the model's
    max_seq_length, or sentence-transformers' default pooling for a plain encoder."""


def warn(message: str) -> None:
    warnings.warn(message, EmbeddingNotice, stacklevel=4)


def check_encoder(model, what: str = "embeddings") -> None:
    if model.args.kind != "encoder":
        raise UserError(f"{what} need an encoder (BERT family); this is a {model.args.kind} model "
                        f"({model.args.model_type}): use mlx-tfm generate")


def sentence_modules(model) -> SentenceModules:
    """What ``mlx_tfm.load`` read from the folder's modules.json (sentence-transformers'
    defaults for a model built otherwise)."""
    return model.sentence_modules or SentenceModules(from_modules_json=False)


def max_tokens(model, modules: SentenceModules) -> int:
    """max_seq_length, never more than the positions the model has."""
    positions = model.args.max_position_embeddings - model.args.position_offset
    if model.args.position_embedding != "learned":
        positions = model.args.max_position_embeddings
    return min(modules.max_seq_length or positions, positions)


def resolve_prompt(modules: SentenceModules, prompt_name: str | None, prompt: str | None) -> str:
    """The text put before every input: ``prompt``, else the named one, else the folder's default."""
    if prompt is not None:
        return prompt
    name = prompt_name if prompt_name is not None else modules.default_prompt_name
    if name is None:
        return ""
    if name not in modules.prompts:
        known = ", ".join(modules.prompts) or "none"
        raise UserError(f"unknown prompt name {name!r}; this model's prompts: {known}")
    return modules.prompts[name]


def tokenize(tokenizer, texts: list[str], pairs: list[str] | None, limit: int,
             notify: Callable[[str], None] | None) -> list[tuple[list[int], list[int]]]:
    """(ids, token type ids) of each text (or pair), cut to ``limit`` tokens with a notice."""
    encoded = tokenizer.encode_truncated(texts, pairs, limit)
    cut = sum(truncated for _, _, truncated in encoded)
    if cut:
        (notify or warn)(f"{cut} of {len(texts)} input(s) longer than {limit} tokens (max_seq_length) "
                         "were truncated")
    return [(ids, types) for ids, types, _ in encoded]


def batches(encoded: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int):
    """(positions in the input, ids (B, L), token types (B, L), mask (B, L)) per batch, the
    longest inputs first so each batch pads little."""
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i][0]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        length = len(encoded[rows[0]][0])
        ids = np.full((len(rows), length), pad_id, dtype=np.int32)
        types = np.zeros((len(rows), length), dtype=np.int32)
        mask = np.zeros((len(rows), length), dtype=np.int32)
        for r, i in enumerate(rows):
            n = len(encoded[i][0])
            ids[r, :n], types[r, :n], mask[r, :n] = encoded[i][0], encoded[i][1], 1
        yield rows, mx.array(ids), mx.array(types), mx.array(mask)


def apply_dense(x: mx.array, layer: DenseLayer) -> mx.array:
    y = x @ layer.weight.T
    return DENSE_ACTIVATIONS[layer.activation](y + layer.bias if layer.bias is not None else y)


def embed_batch(model, ids, types, mask, modules: SentenceModules, pooling: tuple[str, ...],
                prompt_length: int) -> mx.array:
    """(B, L) -> (B, dims): the hidden states pooled (each mode, concatenated), then Dense."""
    hidden = model.hidden_states(ids, types, mask).astype(mx.float32)
    pool_mask = mask
    if prompt_length:  # include_prompt false: the prompt's tokens are left out of the pooling
        pool_mask = mask * (mx.arange(mask.shape[1]) >= prompt_length)
    vectors = mx.concatenate([pool(hidden, pool_mask, mode) for mode in pooling], axis=-1)
    for layer in modules.dense:
        vectors = apply_dense(vectors, layer)
    return vectors


def encode(model, tokenizer, texts: str | list[str], batch_size: int = 32, normalize: bool | None = None,
           prompt_name: str | None = None, truncate_dim: int | None = None, *, prompt: str | None = None,
           pooling: str | None = None, notify: Callable[[str], None] | None = None) -> np.ndarray:
    """Embeddings (N, dims) float32 of ``texts`` (one (dims,) vector for a single string).

    ``normalize``: None follows the folder (its Normalize module), True / False force it;
    ``truncate_dim`` keeps the first dimensions (Matryoshka), before normalising (more
    than the model has is a ``UserError``);
    ``pooling`` overrides the folder's mode; ``notify(message)`` hears about truncated
    texts and defaults (default: an ``EmbeddingNotice`` warning)."""
    check_encoder(model)
    single = isinstance(texts, str)
    texts = [texts] if single else list(texts)
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}")
    modules = sentence_modules(model)
    modes = modules.pooling if pooling is None else (pooling,)
    check_truncate_dim(model, truncate_dim, modes)
    if not modules.from_modules_json and pooling is None:
        (notify or warn)("the model folder has no modules.json: mean pooling, as sentence-transformers defaults")
    check_pooling(modes, "--pooling")
    prefix = resolve_prompt(modules, prompt_name, prompt)
    limit = max_tokens(model, modules)
    encoded = tokenize(tokenizer, [prefix + t for t in texts], None, limit, notify)
    prompt_length = 0
    if prefix and not modules.include_prompt:
        prompt_length = len(tokenize(tokenizer, [prefix], None, limit, notify)[0][0]) - 1
    pad_id = tokenizer.special_token_id("pad_token") or 0
    result = embed_encoded(model, encoded, pad_id, batch_size, normalize, truncate_dim, modes, prompt_length)
    return result[0] if single else result


def embed_encoded(model, encoded: list[tuple[list[int], list[int]]], pad_id: int = 0, batch_size: int = 32,
                  normalize: bool | None = None, truncate_dim: int | None = None, pooling: tuple[str, ...] | None = None,
                  prompt_length: int = 0) -> np.ndarray:
    """Embeddings (N, dims) of texts already tokenized: (ids, token type ids) each, within
    the model's max_seq_length. ``pooling`` None: the folder's modes."""
    modules = sentence_modules(model)
    modes = modules.pooling if pooling is None else pooling
    check_truncate_dim(model, truncate_dim, modes)
    out: list[np.ndarray | None] = [None] * len(encoded)
    for rows, ids, types, mask in batches(encoded, batch_size, pad_id):
        vectors = embed_batch(model, ids, types, mask, modules, modes, prompt_length)
        vectors = finish(vectors, truncate_dim, modules.normalize if normalize is None else normalize)
        for row, vector in zip(rows, np.array(vectors)):
            out[row] = vector
    return np.stack(out) if out else np.zeros((0, 0), np.float32)


def embedding_width(model, pooling: tuple[str, ...] | None = None) -> int:
    """How many dimensions the embeddings have before any truncation: the last Dense
    layer's outputs, else the hidden size once per pooling mode (they are concatenated).
    ``pooling`` None: the folder's modes."""
    modules = sentence_modules(model)
    if modules.dense:
        return int(modules.dense[-1].weight.shape[0])  # weight: (out, in)
    return model.args.hidden_size * len(modules.pooling if pooling is None else pooling)


def check_truncate_dim(model, truncate_dim: int | None, pooling: tuple[str, ...] | None = None) -> None:
    """One-line ``UserError`` for a ``truncate_dim`` the embeddings cannot be cut to: a
    wider one would silently give fewer dimensions than asked for."""
    if truncate_dim is None:
        return
    if truncate_dim < 1:
        raise UserError(f"dimensions must be at least 1, got {truncate_dim}")
    width = embedding_width(model, pooling)
    if truncate_dim > width:
        raise UserError(f"dimensions must be at most {width} (this model's embedding size), got {truncate_dim}")


def finish(vectors: mx.array, truncate_dim: int | None, normalize: bool) -> mx.array:
    """Keep the first ``truncate_dim`` dimensions, then scale each vector to length 1."""
    if truncate_dim is not None:
        vectors = vectors[:, :truncate_dim]
    if normalize:
        vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    return vectors


__all__ = ["encode", "embed_encoded", "EmbeddingNotice", "check_encoder", "check_truncate_dim", "embedding_width",
           "tokenize", "batches", "max_tokens", "sentence_modules"]
