"""Perplexity: how well a model predicts a text, in one number with its standard error.

``exp(mean cross-entropy)`` of each scored token given the tokens before it in its window.
Quantizing weights or the KV cache costs a little of it: this is the number to compare.

The text becomes one token stream: a ``.txt`` file as it is (BOS first); a ``.jsonl`` file
or a folder as ``mlx-tfm lora`` reads them (``{"text"}``, ``{"prompt", "completion"}``,
``{"messages"}``; each record with its EOS), the records shuffled with ``seed`` as
``mlx_lm.perplexity`` does. The stream is cut into windows of ``sequence_length`` tokens:

- ``stride`` = ``sequence_length`` (the default): back to back, ``mlx_lm.perplexity``'s
  windows; each predicts its tokens 2..L from the ones before, the first of each window is
  context only. The same data and settings give mlx_lm's number.
- ``stride`` < ``sequence_length``: windows overlap (transformers' sliding-window recipe);
  the first scores all its predictions, each later one only its last ``stride`` tokens,
  which then have at least ``sequence_length - stride`` tokens of context.

Only whole windows count (a shorter tail is left out); ``num_samples`` keeps the first
windows. The standard error is mlx_lm's: the tokens' losses' standard deviation over
``sqrt(n)``, carried to the perplexity by the delta method (times the perplexity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..errors import UserError
from ..model.cache import KVQuantization, quantized_layers
from ..datasets import DEFAULT_SEED, read_token_stream
from .sampling import log_normalizer

LOGITS_PER_CHUNK = 1 << 23  # float32 logits computed at once (32 MB): a 49152-token head takes ~170 positions


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    standard_error: float  # of the perplexity
    mean_loss: float  # nats per scored token
    tokens: int  # tokens scored
    windows: int

    def __str__(self) -> str:
        return (f"Perplexity: {self.perplexity:.3f} ± {self.standard_error:.3f} "
                f"({self.tokens} tokens in {self.windows} windows; {self.mean_loss:.4f} nats per token)")


# -- data ----------------------------------------------------------------------------------


def windows(n_tokens: int, sequence_length: int, stride: int) -> list[tuple[int, int]]:
    """(start, first scored prediction) of each whole window: prediction j of a window is
    its token j + 1 from tokens 0..j."""
    later = max(0, sequence_length - stride - 1)
    return [(start, 0 if start == 0 else later) for start in range(0, n_tokens - sequence_length + 1, stride)]


# -- the computation -----------------------------------------------------------------------


def token_losses(model, inputs: mx.array, targets: mx.array, cache: list | None = None) -> mx.array:
    """Cross-entropy (B, L) of each target given the inputs up to it, the logits computed
    in float32 a chunk of positions at a time (a (B, L, vocab) tensor is never held).
    With an empty ``cache`` the keys and values go through it (a quantized one: attention
    reads them quantized)."""
    hidden = model.model(inputs, cache=cache)  # (B, L, D)
    B, L, _ = hidden.shape
    chunk = max(1, LOGITS_PER_CHUNK // (B * model.args.vocab_size))
    losses = []
    for start in range(0, L, chunk):
        logits = model.head(hidden[:, start : start + chunk]).astype(mx.float32)  # (B, chunk, V)
        picked = mx.take_along_axis(logits, targets[:, start : start + chunk, None], axis=-1)[..., 0]
        losses.append(log_normalizer(logits)[..., 0] - picked)
    return mx.concatenate(losses, axis=1)


def check_settings(sequence_length: int, stride: int, num_samples: int, batch_size: int) -> None:
    checks = [
        (sequence_length >= 2, f"--sequence-length must be at least 2, got {sequence_length}"),
        (1 <= stride <= sequence_length, f"--stride must be between 1 and --sequence-length {sequence_length}, "
                                         f"got {stride}"),
        (num_samples == -1 or num_samples >= 1, f"--num-samples must be at least 1 (or -1: all), got {num_samples}"),
        (batch_size >= 1, f"--batch-size must be at least 1, got {batch_size}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def perplexity(model, tokenizer, data, sequence_length: int = 512, stride: int | None = None,
               num_samples: int = -1, batch_size: int = 8, seed: int = DEFAULT_SEED, split: str | None = None,
               kv_bits: int | None = None, kv_group_size: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """The perplexity of ``model`` on ``data``: a path (see the module docstring) or token
    ids. With ``kv_bits`` every key and value goes through a ``QuantizedKVCache`` (from
    position 0), which measures what quantizing the cache costs; ``kv_group_size`` None is
    the head's default (``default_kv_group_size``). ``progress(done, total)``
    is called after each batch of windows."""
    stride = sequence_length if stride is None else stride
    check_settings(sequence_length, stride, num_samples, batch_size)
    quantization = None if kv_bits is None else KVQuantization(kv_bits, kv_group_size, start=0)
    if quantization is not None:
        quantization.check(model.args.head_dim)
    tokens = read_token_stream(data, tokenizer, seed, split) if isinstance(data, (str, Path)) else mx.array(data)
    tokens = tokens.reshape(-1).astype(mx.int32)
    spans = windows(tokens.size, sequence_length, stride)
    if not spans:
        raise UserError(f"the data holds {tokens.size} tokens, fewer than one window of --sequence-length "
                        f"{sequence_length}")
    spans = spans if num_samples == -1 else spans[:num_samples]
    scored = []
    for done in range(0, len(spans), batch_size):
        batch = spans[done : done + batch_size]
        rows = mx.stack([tokens[start : start + sequence_length] for start, _ in batch])  # (B, L)
        cache = None if quantization is None else quantized_layers(model.make_cache(), quantization)
        losses = token_losses(model, rows[:, :-1], rows[:, 1:], cache)  # (B, L - 1)
        scored += [row[first:] for row, (_, first) in zip(losses, batch)]
        mx.eval(scored)
        if progress is not None:
            progress(min(done + batch_size, len(spans)), len(spans))
    return summarize(mx.concatenate(scored), len(spans))


def summarize(losses: mx.array, n_windows: int) -> PerplexityResult:
    mean = losses.mean().item()
    ppl = math.exp(mean)
    spread = mx.sqrt(mx.var(losses, ddof=1)).item() if losses.size > 1 else 0.0
    return PerplexityResult(perplexity=ppl, standard_error=ppl * spread / math.sqrt(losses.size), mean_loss=mean,
                            tokens=losses.size, windows=n_windows)


__all__ = ["perplexity", "PerplexityResult", "read_token_stream", "windows"]
