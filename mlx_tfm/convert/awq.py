"""Activation-aware scaling before quantization (AWQ, Lin et al. 2023), for ``convert -q --awq``.

A few input channels of each matrix carry much larger activations than the rest, so the
rounding error of their weights costs the most. AWQ multiplies those columns by a scale
``s`` before quantizing, and divides whatever produces the matrix's input by ``s``: the
float model computes exactly the same function (``(x / s) @ (W * s).T == x @ W.T``), but the
quantized one rounds the important weights more finely. Per group of matrices that read the
same input, ``s = mean|x| ** alpha`` (normalised), with ``alpha`` chosen on a grid to make the
quantized products closest to the float ones on calibration text; ``alpha = 0`` (no scaling)
is on the grid, so on that text the result is never worse than plain rounding.

The groups of a pre-norm block, and what absorbs ``1 / s``:
- q, k, v read the attention norm's output: the norm's weight (and bias);
- gate and up read the MLP norm's output: the norm's weight (and bias);
- down reads ``act(gate) * up``, linear in up: up's output rows;
- o reads the heads' mixes of v, linear in v: v's output rows (when every query head has
  its own key/value head, so each column of o has one row of v).
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..datasets import read_token_stream
from ..errors import UserError
from ..tokenizer import load_tokenizer
from ..weights.build import build_model

GRID = 20  # alphas 0, 1/20, ..., 19/20 (mlx-lm's n_grid)
SEARCH_ROWS = 4096  # calibration tokens each scale search reads (a random subset)
CLIP_RATIOS = tuple(1 - k / 20 for k in range(10))  # 1.0, 0.95, ..., 0.55 of each group's range
CLIP_ROWS = 512  # calibration tokens each clip search reads
CLIP_CHUNK = 1024  # output rows searched at once (bounds the (T, rows, groups) error array)


class Recorder(nn.Module):
    """Stands in for a module during one block's pass and keeps what it saw."""

    def __init__(self, inner, keep: str):
        super().__init__()
        self.inner, self.keep, self.seen = inner, keep, None

    def __call__(self, x, *args, **kwargs):
        out = self.inner(x, *args, **kwargs)
        self.seen = x if self.keep == "input" else out
        return out


def check_awq_model(model) -> None:
    """One line unless every block is pre-norm attention + a gated MLP with plain norms."""
    args = model.args
    problem = None
    if args.num_experts:
        problem = "mixtures of experts"
    elif args.norm_placement != "pre" or args.norm_weight_offset:
        problem = f"norm placement {args.norm_placement!r}" + (" with offset norms" if args.norm_weight_offset else "")
    elif not args.ffn_gated or set(args.layer_types) - {"full_attention", "sliding_attention"}:
        problem = "ungated MLPs or non-attention layers"
    if problem is not None:
        raise UserError(f"--awq supports pre-norm attention + gated-MLP models (llama, mistral, qwen2, qwen3, ...); "
                        f"this {args.model_type} has {problem}")


def calibration_windows(data: str | Path, tokenizer, samples: int, sequence_length: int) -> mx.array:
    """(samples, sequence_length) token windows cut back to back from ``data`` (a text file,
    a jsonl file or a data folder's train split)."""
    tokens = read_token_stream(data, tokenizer, split="train" if Path(data).is_dir() else None,
                               flag="--calibration-data")
    n = min(samples, tokens.size // sequence_length)
    if n < 1:
        raise UserError(f"--calibration-data {data} has {tokens.size} tokens, fewer than one window of "
                        f"{sequence_length} (--awq-sequence-length)")
    return tokens[: n * sequence_length].reshape(n, sequence_length)  # (N, L)


def block_inputs(model, windows: mx.array) -> tuple[mx.array, list]:
    """The first block's input (N, L, D) and every block's mask, from one pass whose blocks
    are skipped (each records its arguments and returns its input unchanged)."""
    seen = {}
    layers = model.model.layers
    real = list(layers)

    def skip(i):
        def record(x, mask=None, cache=None, *rest, **kw):
            seen.setdefault(i, (x, mask))
            return x
        return record

    for i in range(len(layers)):
        layers[i] = skip(i)
    try:
        model.model(windows)
    finally:
        for i, layer in enumerate(real):
            layers[i] = layer
    return seen[0][0], [seen[i][1] for i in range(len(real))]


def search_scale(x: mx.array, weights: list[mx.array], group_size: int, bits: int) -> mx.array:
    """The scale (D,) of the input channels that makes the quantized products of ``x``
    (T, D) with ``weights`` (each (O, D)) closest to the float ones."""
    w = mx.concatenate(weights, axis=0).astype(mx.float32)  # (sum O, D)
    x = x.astype(mx.float32)
    reference = x @ w.T
    stat = mx.maximum(mx.mean(mx.abs(x), axis=0), 1e-4)  # (D,)
    best, best_error = mx.ones_like(stat), None
    for k in range(GRID):
        s = stat ** (k / GRID)
        s = s / mx.sqrt(s.max() * s.min())
        rounded = mx.dequantize(*mx.quantize(w * s, group_size, bits), group_size, bits) / s
        error = mx.mean(mx.square(x @ rounded.T - reference)).item()
        if best_error is None or error < best_error:
            best, best_error = s, error
    return best


def clip_search(x: mx.array, w: mx.array, group_size: int, bits: int) -> mx.array:
    """``w`` (O, D) with each group of ``group_size`` weights of a row clipped to the share
    of its range that makes that group's part of ``x @ w.T`` (x (T, D)) closest to the
    float one once quantized (AWQ's second step: a narrower range rounds the many small
    weights more finely, at the cost of the few large ones)."""
    O, D = w.shape
    w = w.astype(mx.float32)
    x = x[:CLIP_ROWS].astype(mx.float32).reshape(-1, D // group_size, group_size)  # (T, G, g)
    grouped = w.reshape(O, D // group_size, group_size)  # (O, G, g)
    low, high = grouped.min(axis=-1, keepdims=True), grouped.max(axis=-1, keepdims=True)
    best, best_error = grouped, None
    for r in CLIP_RATIOS:
        clipped = mx.clip(grouped, low * r, high * r)
        rounded = mx.dequantize(*mx.quantize(clipped.reshape(O, D), group_size, bits), group_size, bits)
        diff = grouped - rounded.reshape(O, D // group_size, group_size)
        error = mx.concatenate([mx.sum(mx.square(mx.einsum("tgk,ogk->tog", x, diff[i:i + CLIP_CHUNK])), axis=0)
                                for i in range(0, O, CLIP_CHUNK)], axis=0)[..., None]  # (O, G, 1)
        if best_error is None:
            best_error = error
        else:
            better = error < best_error
            best, best_error = mx.where(better, clipped, best), mx.minimum(error, best_error)
        mx.eval(best, best_error)
    return best.reshape(O, D)


def divide_rows(module, s: mx.array) -> None:
    """The module's outputs / s: a norm's weight (and bias), or a Linear's rows."""
    column = s if module.weight.ndim == 1 else s[:, None]
    module.weight = module.weight / column.astype(module.weight.dtype)
    if "bias" in module:
        module.bias = module.bias / s.astype(module.bias.dtype)


def multiply_columns(linears: list, s: mx.array) -> None:
    for linear in linears:
        linear.weight = linear.weight * s.astype(linear.weight.dtype)


def sample_rows(x: mx.array) -> mx.array:
    """At most SEARCH_ROWS positions of ``x`` (N, L, D) as rows (T, D)."""
    rows = x.reshape(-1, x.shape[-1])  # (N * L, D)
    if rows.shape[0] <= SEARCH_ROWS:
        return rows
    return rows[mx.random.permutation(rows.shape[0], key=mx.random.key(0))[:SEARCH_ROWS]]


def scale_block(block, h: mx.array, mask, group_size: int, bits: int, clip: bool = True) -> mx.array:
    """Scale one block's matrices in place; returns its output for the next block (the
    float function is unchanged, so it is computed once, before scaling)."""
    attention, mlp = block.self_attn, block.mlp
    probes = {"attention_in": ("input_layernorm", "output"), "mlp_in": ("post_attention_layernorm", "output")}
    originals = {name: block[name] for name, _ in probes.values()} | {"down": mlp.down_proj, "o": attention.o_proj}
    for key, (name, keep) in probes.items():
        block[name] = Recorder(originals[name], keep)
    mlp.down_proj, attention.o_proj = Recorder(originals["down"], "input"), Recorder(originals["o"], "input")
    try:
        out = block(h, mask)
        mx.eval(out)
        seen = {key: block[name].seen for key, (name, _) in probes.items()}
        seen |= {"down": mlp.down_proj.seen, "o": attention.o_proj.seen}
    finally:
        for name, _ in probes.values():
            block[name] = originals[name]
        mlp.down_proj, attention.o_proj = originals["down"], originals["o"]
    groups = [("attention_in", block.input_layernorm, [attention.q_proj, attention.k_proj, attention.v_proj]),
              ("mlp_in", block.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj]),
              ("down", mlp.up_proj, [mlp.down_proj])]
    if attention.v_proj.weight.shape[0] == attention.o_proj.weight.shape[1]:  # one v row per o column
        groups.append(("o", attention.v_proj, [attention.o_proj]))
    clipped = {id(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, attention.v_proj, attention.o_proj)}
    for key, producer, consumers in groups:  # (up, v: clipped, then rows divided: ranges scale along)
        if any(c.weight.shape[1] % group_size for c in consumers):  # left in float by the quantizer
            continue
        x = sample_rows(seen[key])
        s = search_scale(x, [c.weight for c in consumers], group_size, bits)
        divide_rows(producer, s)
        multiply_columns(consumers, s)
        for consumer in consumers:  # q and k are left unclipped: attention scores amplify their error
            if clip and id(consumer) in clipped:
                consumer.weight = clip_search(x / s, consumer.weight, group_size, bits).astype(consumer.weight.dtype)
    mx.eval(block.parameters())
    return out


def awq_weights(config: dict, weights: dict, origin: Path, data: str | Path, group_size: int, bits: int,
                samples: int = 32, sequence_length: int = 512, clip: bool = True, log=print) -> dict:
    """``weights`` (on-disk names) with every block's scales applied (and, ``clip``, each
    group's range clipped), ready to quantize."""
    model = build_model(config, weights, origin, mx.float32)
    if set(dict(tree_flatten(model.parameters()))) != set(weights):
        raise UserError(f"--awq reads checkpoints whose tensor names are the model's own; {config['model_type']}'s differ")
    check_awq_model(model)
    if not Path(origin).is_dir():
        raise UserError("--awq reads a model folder (its tokenizer tokenizes the calibration text)")
    windows = calibration_windows(data, load_tokenizer(origin), samples, sequence_length)
    log(f"AWQ: calibrating on {windows.shape[0]} windows of {windows.shape[1]} tokens from {data}")
    h, masks = block_inputs(model, windows)
    start = time.monotonic()
    for i, (block, mask) in enumerate(zip(model.layers, masks)):
        h = scale_block(block, h, mask, group_size, bits, clip)
        elapsed = time.monotonic() - start
        log(f"  block {i + 1}/{len(masks)}, {elapsed:.0f} s, ETA {elapsed / (i + 1) * (len(masks) - i - 1):.0f} s, "
            f"{mx.get_peak_memory() / 1e9:.2f} GB peak")
    scaled = dict(tree_flatten(model.parameters()))
    return {name: scaled[name].astype(weights[name].dtype) for name in weights}
