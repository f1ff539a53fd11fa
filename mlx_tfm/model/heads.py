"""What sits on an encoder's hidden states: pooling one vector per text, the masked-LM head
that predicts the token at each position, and the classification head of cross-encoders
(rerankers) and other sequence classifiers.

Pooling follows sentence-transformers' ``Pooling`` module mode by mode; the heads follow
the BERT family's layouts, one module each: ``dense -> activation -> LayerNorm -> decoder``
(masked LM: BERT, RoBERTa, DistilBERT, ModernBERT) and ``pool -> dense -> activation ->
[LayerNorm] -> out_proj`` (classification: BERT's pooler, RoBERTa's classification head,
DistilBERT's pre-classifier, ModernBERT's head).

Shapes: B batch, L positions, D hidden size; ``mask`` (B, L) is 1 for tokens, 0 for padding.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

POOLING_MODES = ("cls", "mean", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean")


def pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """(B, L, D) hidden states -> (B, D), one vector per text, as sentence-transformers
    pools (right padding)."""
    if mode not in POOLING_MODES:
        raise ValueError(f"unknown pooling mode {mode!r}; known: {', '.join(POOLING_MODES)}")
    weights = mask.astype(hidden.dtype)[..., None]  # (B, L, 1)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return mx.where(weights > 0, hidden, -mx.inf).max(axis=1)
    if mode == "lasttoken":
        last = mask.astype(mx.int32).sum(axis=1) - 1  # (B,) the last token of each right-padded row
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if mode == "weightedmean":
        weights = weights * mx.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[None, :, None]
    summed = (hidden * weights).sum(axis=1)
    count = mx.maximum(weights.sum(axis=1), 1e-9)
    return summed / (mx.sqrt(count) if mode == "mean_sqrt_len_tokens" else count)


HEAD_ACTIVATIONS = {"gelu": nn.gelu, "gelu_tanh": nn.gelu_approx, "relu": nn.relu, "tanh": mx.tanh,
                    "silu": nn.silu}


def head_activation(name: str):
    if name not in HEAD_ACTIVATIONS:
        raise ValueError(f"unknown head activation {name!r} ({', '.join(HEAD_ACTIVATIONS)})")
    return HEAD_ACTIVATIONS[name]


class MaskedLMHead(nn.Module):
    """Hidden states (B, L, D) -> logits (B, L, V): a dense layer, its activation and a
    LayerNorm, then the token embedding (tied) or the head's own ``decoder`` and a bias."""

    def __init__(self, args):
        super().__init__()
        D = args.hidden_size
        self.dense = nn.Linear(D, D, bias=args.head_bias)
        self.act = head_activation(args.head_activation)
        self.norm = nn.LayerNorm(D, eps=args.norm_eps, bias=args.norm_bias)
        self.tied = args.tie_word_embeddings
        if not self.tied:
            self.decoder = nn.Linear(D, args.vocab_size, bias=False)
        if args.decoder_bias:
            self.bias = mx.zeros((args.vocab_size,))

    def __call__(self, hidden: mx.array, embedding: nn.Module) -> mx.array:
        h = self.norm(self.act(self.dense(hidden)))
        logits = embedding.as_linear(h) if self.tied else self.decoder(h)
        return logits + self.bias if "bias" in self else logits


class ClassificationHead(nn.Module):
    """Hidden states (B, L, D) and the padding mask -> class logits (B, num_labels): the
    pooled vector (first token or mean), a dense layer and its activation (tanh for BERT's
    pooler and RoBERTa, ReLU for DistilBERT, GELU and a LayerNorm for ModernBERT), then
    ``out_proj``. A cross-encoder's relevance score is its single logit."""

    def __init__(self, args):
        super().__init__()
        D = args.hidden_size
        self.pooling = args.classifier_pooling
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"unknown classifier_pooling {self.pooling!r} (cls, mean)")
        self.dense = nn.Linear(D, D, bias=args.head_bias)
        self.act = head_activation(args.classifier_activation)
        if args.classifier_norm:
            self.norm = nn.LayerNorm(D, eps=args.norm_eps, bias=args.norm_bias)
        self.out_proj = nn.Linear(D, args.num_labels)

    def __call__(self, hidden: mx.array, mask: mx.array) -> mx.array:
        h = self.act(self.dense(pool(hidden, mask, self.pooling)))
        if "norm" in self:
            h = self.norm(h)
        return self.out_proj(h)


__all__ = ["pool", "POOLING_MODES", "MaskedLMHead", "ClassificationHead"]
