"""One prompt through the model, as the model computes it: what each block's attention
weighs, the residual stream's norm after each block, and the logit lens.

``trace`` runs the model's own forward pass with each block wrapped, for that one call, to
keep its input and output: the stream is exactly the model's, whatever its norm placement,
positions or windows. The fused attention kernel never shows its weights, so the call of
the model's attention function (``mlx_tfm.model.attention.attention``, as the attention sublayer
calls it) is kept too: the queries and keys it receives (after the projections, q/k norms
and RoPE, whichever the model has), its scale, mask, soft-cap and sinks. The weights
softmax(q k^T * scale) are recomputed from those, for pictures only; the tests prove that
weights @ V through o_proj reproduces the attention's output.

The logit lens (nostalgebraist, 2020) reads each state of the residual stream through the
final norm and the head, as if the model stopped there: the last state gives the model's
own logits.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserError
from ..model import attention as attention_module
from ..model.cache import window_mask


@dataclass
class AttentionCall:
    """What one call of the model's attention function received."""

    queries: mx.array  # (B, n_heads, L, head_dim)
    keys: mx.array  # (B, n_kv_heads, S, head_dim)
    values: mx.array  # (B, n_kv_heads, S, head_dim)
    scale: float
    mask: Any  # None, "causal", boolean or additive
    softcap: float | None
    sinks: mx.array | None  # (n_heads,)


@contextmanager
def attention_calls():
    """Within the block, every call of the model's attention function is appended to the
    yielded list (and computed as usual)."""
    original = attention_module.attention
    signature = inspect.signature(original)
    calls: list[AttentionCall] = []

    def recorded(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        calls.append(AttentionCall(given["queries"], given["keys"], given["values"], given["scale"], given.get("mask"),
                                   given.get("softcap"), given.get("sinks")))
        return original(*args, **kwargs)

    attention_module.attention = recorded
    try:
        yield calls
    finally:
        attention_module.attention = original


@dataclass
class Trace:
    token_ids: list[int]
    stream: list[mx.array]  # (L, D) each: after the embeddings, then after each block
    attention: list[AttentionCall]  # one per block
    logits: mx.array  # (L, vocab): the model's own output


class Recorder(nn.Module):
    """Calls ``inner`` as the model would and hands its input and output to ``record``."""

    def __init__(self, inner: nn.Module, record: Callable):
        super().__init__()
        self.inner = inner
        self.record = record  # a plain attribute: not a parameter, not a child

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        out = self.inner(x, *args, **kwargs)  # mask, cache and whatever else the model passes
        self.record(x, out)
        return out


@contextmanager
def recording_blocks(model: nn.Module, on_block: Callable):
    """Within the block, block i calls ``on_block(i, x, out)``; the model is restored
    after, even on an error."""
    layers = model.layers  # the very list the forward pass walks
    blocks = list(layers)
    try:
        for i, block in enumerate(blocks):
            layers[i] = Recorder(block, partial(on_block, i))
        yield
    finally:
        layers[:] = blocks


def trace(model: nn.Module, token_ids: list[int]) -> Trace:
    """Run ``token_ids`` (one sequence) through the model and keep its residual stream
    and what each block's attention received."""
    stream: list[mx.array | None] = [None] * (len(model.layers) + 1)

    def on_block(i, x, out):
        if i == 0:
            stream[0] = x[0]
        stream[i + 1] = out[0]

    with recording_blocks(model, on_block), attention_calls() as calls:
        logits = model(mx.array([token_ids]))[0]
    if len(calls) != len(model.layers):
        raise UserError(f"{len(calls)} attention calls for {len(model.layers)} blocks: this model's attention "
                        "does not go through mlx_tfm.model.attention.attention, so its maps cannot be drawn")
    mx.eval(logits, stream)
    return Trace(list(token_ids), stream, calls, logits)


def masked(scores: mx.array, mask) -> mx.array:
    """Apply a mask as the model passes it: None, "causal", boolean (True = may attend) or additive."""
    if mask is None:
        return scores
    if isinstance(mask, str):  # "causal": the last L of S positions, as the fused op aligns it
        L, S = scores.shape[-2:]
        mask = window_mask(mx.arange(S - L, S), mx.arange(S), None)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -mx.inf)
    return scores + mask


def weights_of(call: AttentionCall) -> mx.array:
    """softmax(q k^T * scale) of one attention call -> (B, n_heads, L, S), float32; a
    sink's logit joins each softmax and takes its share without a column of its own."""
    queries, keys = call.queries.astype(mx.float32), call.keys.astype(mx.float32)
    # GQA: each group of n_heads / n_kv_heads query heads reads one KV head.
    keys = mx.repeat(keys, queries.shape[1] // keys.shape[1], axis=1)
    scores = (queries * call.scale) @ keys.transpose(0, 1, 3, 2)  # (B, n_heads, L, S)
    if call.softcap:
        scores = mx.tanh(scores / call.softcap) * call.softcap
    scores = masked(scores, call.mask)
    if call.sinks is None:
        return mx.softmax(scores, axis=-1)
    B, H, L, _ = scores.shape
    sinks = mx.broadcast_to(call.sinks.astype(mx.float32).reshape(1, H, 1, 1), (B, H, L, 1))
    return mx.softmax(mx.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]


def attention_weights(attn: nn.Module, x: mx.array, mask="causal") -> mx.array:
    """The attention weights of one Attention module for its input x (1, L, D) under
    ``mask`` -> (heads, L, L), float32; rows are queries, columns keys."""
    with attention_calls() as calls:
        mx.eval(attn(x, mask))
    return weights_of(calls[0])[0]


def layer_attention(recorded: Trace) -> list[np.ndarray]:
    """Per block, every head's attention weights (heads, L, L)."""
    return [np.array(weights_of(call)[0]) for call in recorded.attention]


def residual_norms(recorded: Trace) -> np.ndarray:
    """(states, L): the L2 norm of each position's residual vector, after the embeddings
    (row 0) and after each block."""
    return np.stack([np.linalg.norm(np.array(state.astype(mx.float32)), axis=-1) for state in recorded.stream])


def lens_logits(model: nn.Module, state: mx.array) -> mx.array:
    """A residual state (L, D) through the final norm and the head -> (L, vocab)."""
    if model.args.final_norm:
        state = model.model.norm(state)
    return model.head(state)


@dataclass
class LogitLens:
    top_ids: np.ndarray  # (states, L): the token each state would predict next
    top_probs: np.ndarray  # (states, L): its probability


def logit_lens(model: nn.Module, recorded: Trace) -> LogitLens:
    ids, probs = [], []
    for state in recorded.stream:
        p = mx.softmax(lens_logits(model, state).astype(mx.float32), axis=-1)
        top = mx.argmax(p, axis=-1)
        ids.append(np.array(top))
        probs.append(np.array(mx.take_along_axis(p, top[:, None], axis=-1)[:, 0]))
    return LogitLens(np.stack(ids), np.stack(probs))


__all__ = ["AttentionCall", "attention_calls", "Trace", "trace", "weights_of", "attention_weights", "layer_attention",
           "residual_norms", "lens_logits",
           "LogitLens", "logit_lens"]
