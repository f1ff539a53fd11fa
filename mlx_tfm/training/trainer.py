"""The training loop: a loss, a compiled step, evaluation, and callbacks for the rest.

Teacher forcing: the model reads tokens[:, :-1] under the causal mask and is scored on
predicting tokens[:, 1:], every position at once, with cross-entropy. A target counts only
where it lies inside the example and past its prompt (``lengths`` holds, per row,
``(prompt_length, length)``).

``train`` knows nothing about files or progress bars: reporting, evaluation output and
saving hang off a ``Callbacks`` object, which the commands fill in.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ..errors import UserError
from .data import Batch
from .options import LoopOptions


@dataclass(frozen=True)
class TrainingArgs:
    """What the loop needs (the commands build it from their options)."""

    batch_size: int = 4
    iters: int = 1000
    val_batches: int = 25  # <= 0: the whole validation set
    steps_per_report: int = 10
    steps_per_eval: int = 200
    steps_per_save: int = 100
    grad_accumulation_steps: int = 1
    grad_clip: float | None = None  # max global L2 norm; None: no clipping
    grad_checkpoint: bool = False
    log_grad_norms: bool = False
    seed: int = 0


def training_args(options: LoopOptions, grad_clip: float | None = None) -> TrainingArgs:
    """The loop's arguments from a command's options (``save_every`` is ``steps_per_save``);
    ``grad_clip`` 0 or None: no clipping."""
    return TrainingArgs(
        batch_size=options.batch_size,
        iters=options.iters,
        val_batches=options.val_batches,
        steps_per_report=options.steps_per_report,
        steps_per_eval=options.steps_per_eval,
        steps_per_save=options.save_every,
        grad_accumulation_steps=options.grad_accumulation_steps,
        grad_clip=grad_clip or None,
        grad_checkpoint=options.grad_checkpoint,
        log_grad_norms=options.log_grad_norms,
        seed=options.seed,
    )


class TrainingDiverged(UserError):
    """The loss stopped being a finite number."""


# -- the loss -----------------------------------------------------------------------


def target_mask(lengths: mx.array, width: int) -> mx.array:
    """(B, width) bool: target t (the token at position t + 1) lies in [prompt, length)."""
    positions = mx.arange(1, width + 1)[None]
    return (positions >= lengths[:, 0:1]) & (positions < lengths[:, 1:2])


# Above this many logits per chunk, the loss is computed a chunk of positions at a time.
LOSS_CHUNK_LOGITS = 8 * 1024 * 1024


def loss_fn(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """Mean next-token cross-entropy over the counted targets, and how many there were."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = target_mask(lengths, targets.shape[1])
    ntoks = mask.sum()
    hidden = model.model(inputs)  # (B, L, D); the model applies the causal mask itself
    return cross_entropy_sum(model, hidden, targets, mask) / mx.maximum(ntoks, 1), ntoks


def _masked_ce_sum(logits: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
    return (nn.losses.cross_entropy(logits, targets) * mask).astype(mx.float32).sum()


def cross_entropy_sum(model: nn.Module, hidden: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
    """Summed cross-entropy of the head's logits. A large (B, L, vocab) logits tensor is
    never held whole: each chunk of positions runs under a checkpoint, so the backward pass
    recomputes its logits instead of storing them (less peak memory for one extra head
    matmul). Small problems take the direct path."""
    B, L, _ = hidden.shape
    chunk = max(1, LOSS_CHUNK_LOGITS // (B * model.args.vocab_size))
    if chunk >= L:
        return _masked_ce_sum(model.head(hidden), targets, mask)
    head_module = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    total = mx.array(0.0)
    for start in range(0, L, chunk):
        # targets and mask enter by closure: a checkpoint input must be differentiable
        part_targets, part_mask = targets[:, start : start + chunk], mask[:, start : start + chunk]

        def part(h, t=part_targets, m=part_mask):
            return _masked_ce_sum(model.head(h), t, m)

        total = total + nn.utils.checkpoint(head_module, part)(hidden[:, start : start + chunk])
    return total


def batch_arrays(batch: Batch) -> tuple:
    """The loss's array arguments of a batch after the model: tokens, lengths, and the
    pixel values of a batch with images (the loss then takes them third)."""
    arrays = (mx.array(batch.tokens), mx.array(batch.lengths))
    if batch.pixel_values is None:
        return arrays
    arrays = (*arrays, mx.array(batch.pixel_values))
    return arrays if not batch.tower_inputs else (*arrays, {k: mx.array(v) for k, v in batch.tower_inputs.items()})


def evaluate(model: nn.Module, batches: Iterable[Batch], loss=loss_fn, group=None) -> float:
    """Token-weighted mean loss over the batches; with a data-parallel ``group``
    (``mx.distributed.Group``), over every rank's batches."""
    total, count = mx.array(0.0), mx.array(0)
    for batch in batches:
        value, ntoks = loss(model, *batch_arrays(batch))
        total, count = total + value * ntoks, count + ntoks
        mx.eval(total, count)
    if group is not None:
        total, count = mx.distributed.all_sum(total, group=group), mx.distributed.all_sum(count, group=group)
    return (total / mx.maximum(count, 1)).item()


# -- gradients ------------------------------------------------------------------------


def layer_grad_norms(grads: dict) -> mx.array:
    """(n_layers,) L2 norm of each block's gradient (zero for a frozen block)."""
    layers = grads["model"]["layers"]
    norms = []
    for layer in layers:
        leaves = [g for _, g in tree_flatten(layer)]
        norms.append(mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for g in leaves)) if leaves else mx.array(0.0))
    return mx.stack(norms)


def enable_grad_checkpoint(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of storing them."""
    for layer in model.layers:
        layer.__class__ = _checkpointed(type(layer))


_CHECKPOINTED: dict[type, type] = {}


def _checkpointed(block: type) -> type:
    """A subclass of ``block`` whose call runs under ``mx.checkpoint`` (same parameters)."""
    if block in _CHECKPOINTED.values():
        return block
    if block not in _CHECKPOINTED:

        def __call__(self, x, mask=None, cache=None):
            return nn.utils.checkpoint(self, partial(block.__call__, self))(x, mask, cache)

        _CHECKPOINTED[block] = type(f"Checkpointed{block.__name__}", (block,), {"__call__": __call__})
    return _CHECKPOINTED[block]


# -- the loop -------------------------------------------------------------------------


class Callbacks:
    """Hooks the loop calls; each does nothing unless a command overrides it."""

    def on_step(self, step: int, loss: float, ntoks: int, info: dict) -> None:
        """After every optimizer step (``info``: learning_rate, grad_norms, ...)."""

    def on_report(self, step: int, info: dict) -> None:
        """Every ``steps_per_report`` steps, with averaged loss and throughput."""

    def on_eval(self, step: int, val_loss: float, seconds: float) -> None:
        """After each validation pass."""

    def on_save(self, step: int) -> None:
        """Every ``steps_per_save`` steps and at the end: persist what must survive."""


def across_ranks(value: mx.array, ntoks: mx.array, grads, group) -> tuple:
    """This rank's mean loss, target count and mean gradient -> the whole batch's, over
    every rank of a data-parallel ``group`` (None: one process, unchanged). Each rank's
    share counts by its targets, as micro-batches do, and the gradients are averaged with
    ``nn.average_gradients`` (a few large all-sums)."""
    if group is None:
        return value, ntoks, grads
    total = mx.distributed.all_sum(ntoks, group=group)
    share = (ntoks * group.size() / mx.maximum(total, 1)).astype(mx.float32)
    grads = nn.average_gradients(tree_map(lambda g: g * share.astype(g.dtype), grads), group)
    return mx.distributed.all_sum(value * ntoks, group=group) / mx.maximum(total, 1), total, grads


def make_step(model: nn.Module, optimizer: optim.Optimizer, args: TrainingArgs, loss=loss_fn, group=None):
    """``step(micro_batches) -> (loss, ntoks, grad_norm, layer_norms)``: compiled gradient
    computation per micro-batch, combined, clipped and applied in one optimizer update.

    Each micro-batch's mean loss and gradient are weighted by its count of target tokens,
    so k micro-batches give the loss and update of one batch of the same examples even
    when prompt masking or padding makes their counts differ. With a data-parallel
    ``group`` each rank runs the step on its share of the batch and the shares are
    combined the same way inside the step (``across_ranks``): every rank applies the
    update one process would, and the loss and count returned are the whole batch's."""
    state = [model.state, optimizer.state, mx.random.state]
    loss_and_grad = nn.value_and_grad(model, loss)

    def update(value, ntoks, grads):
        value, ntoks, grads = across_ranks(value, ntoks, grads, group)
        grad_norm = mx.array(0.0)
        if args.grad_clip:
            grads, grad_norm = optim.clip_grad_norm(grads, args.grad_clip)
        layer_norms = layer_grad_norms(grads) if args.log_grad_norms else mx.array(0.0)
        optimizer.update(model, grads)
        return value, ntoks, grad_norm, layer_norms

    def plain_step(*arrays):  # tokens, lengths[, pixel values[, tower inputs]]
        (value, ntoks), grads = loss_and_grad(model, *arrays)
        return update(value, ntoks, grads)

    def plain_grads(*arrays):
        (value, ntoks), grads = loss_and_grad(model, *arrays)
        return value, ntoks, grads

    full_step, micro_grads = (partial(mx.compile, inputs=state, outputs=state)(f) for f in (plain_step, plain_grads))
    compiled_update = mx.compile(update, inputs=state, outputs=state)

    def step(micro_batches: list[Batch]):
        # a tower that reads its other inputs' values on the host (LLaVA-NeXT's image sizes,
        # LFM2-VL's patch grids) cannot be traced: such batches run uncompiled
        host_read = any(batch.tower_inputs for batch in micro_batches)
        if len(micro_batches) == 1:
            return (plain_step if host_read else full_step)(*batch_arrays(micro_batches[0]))
        loss_sum, ntoks_sum, grad_sum = mx.array(0.0), mx.array(0), None
        for batch in micro_batches:
            value, ntoks, grads = (plain_grads if host_read else micro_grads)(*batch_arrays(batch))
            # mean x count: this micro-batch's sum over its tokens
            grads = tree_map(lambda g: g * ntoks.astype(g.dtype), grads)
            grad_sum = grads if grad_sum is None else tree_map(mx.add, grad_sum, grads)
            loss_sum, ntoks_sum = loss_sum + value * ntoks, ntoks_sum + ntoks
            mx.eval(grad_sum, loss_sum, ntoks_sum)  # bound memory to one micro-batch's activations
        scale = 1 / mx.maximum(ntoks_sum, 1)
        grads = tree_map(lambda g: g * scale.astype(g.dtype), grad_sum)
        return compiled_update(loss_sum * scale, ntoks_sum, grads)

    return step


def train(
    model: nn.Module,
    optimizer: optim.Optimizer,
    train_batches: Callable[[int], Batch],
    valid_batches: Callable[[], Iterable[Batch]] | None,
    args: TrainingArgs,
    callbacks: Callbacks | None = None,
    start_step: int = 0,
    loss=loss_fn,
    group=None,
) -> list[float]:
    """Run optimizer steps ``start_step + 1 .. args.iters``; return each step's loss.

    ``train_batches(i)`` is the i-th micro-batch (a pure function of i, so a resumed run
    continues the same trajectory); the random state for dropout is reseeded per step.
    With a data-parallel ``group`` (``mx.distributed.Group``) every rank calls ``train``
    with its share of each batch and of the validation batches: the steps, the losses
    and the token counts reported are the whole batch's.
    """
    callbacks = callbacks or Callbacks()
    if args.grad_checkpoint:
        enable_grad_checkpoint(model)
    model.train()
    step_fn = make_step(model, optimizer, args, loss, group)
    accumulation = args.grad_accumulation_steps
    evaluating = valid_batches is not None and args.steps_per_eval > 0
    if evaluating and start_step == 0:
        _validate(model, valid_batches, loss, callbacks, 0, group)
    losses, window = [], _ReportWindow()
    for step in range(start_step + 1, args.iters + 1):
        mx.random.seed(args.seed * 1_000_003 + step)
        micro = [train_batches((step - 1) * accumulation + i) for i in range(accumulation)]
        value, ntoks, grad_norm, layer_norms = step_fn(micro)
        mx.eval(value, ntoks, grad_norm, layer_norms, model.state, optimizer.state)
        value = value.item()
        if not math.isfinite(value):
            raise TrainingDiverged(f"the loss became {value} at step {step}; stopped without saving this step")
        losses.append(value)
        info = {"learning_rate": optimizer.learning_rate.item(), "grad_norm": grad_norm.item()}
        if args.log_grad_norms:
            info["layer_grad_norms"] = np.array(layer_norms).tolist()
        callbacks.on_step(step, value, int(ntoks.item()), info)
        window.add(value, int(ntoks.item()))
        if step % args.steps_per_report == 0 or step == args.iters:
            callbacks.on_report(step, {**info, **window.summary()})
            window = _ReportWindow()
        if evaluating and (step % args.steps_per_eval == 0 or step == args.iters):
            window.start += _validate(model, valid_batches, loss, callbacks, step, group)
        if step % args.steps_per_save == 0 or step == args.iters:
            callbacks.on_save(step)
    return losses


def _validate(model, valid_batches, loss, callbacks: Callbacks, step: int, group=None) -> float:
    """Evaluate and report; return the seconds spent (kept out of the throughput)."""
    start = time.perf_counter()
    model.eval()
    val_loss = evaluate(model, valid_batches(), loss, group)
    model.train()
    seconds = time.perf_counter() - start
    callbacks.on_eval(step, val_loss, seconds)
    return seconds


class _ReportWindow:
    """Loss and throughput over the steps since the last report (validation excluded)."""

    def __init__(self):
        self.start, self.losses, self.tokens, self.steps = time.perf_counter(), [], 0, 0

    def add(self, loss: float, ntoks: int) -> None:
        self.losses.append(loss)
        self.tokens += ntoks
        self.steps += 1

    def summary(self) -> dict:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return {
            "train_loss": sum(self.losses) / len(self.losses),
            "tokens_per_second": self.tokens / seconds,
            "iterations_per_second": self.steps / seconds,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
        }
