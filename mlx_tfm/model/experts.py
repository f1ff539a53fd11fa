"""Mixture of experts: the feed-forward sublayer as ``num_experts`` small FFNs ("experts")
of which a router picks ``num_experts_per_tok`` for each position.

    indices, weights = route(router(x))                     # (..., k) each
    y = sum_j weights_j * expert_{indices_j}(x)  [+ shared expert(x)]

The experts' projections are stored stacked, one (num_experts, out, in) array per
projection (``switch_mlp.gate_proj.weight``...: mlx-lm's layout), and multiplied with
``mx.gather_mm`` / ``mx.gather_qmm``, which read only the chosen experts' matrices. With
many positions (a prompt) the (position, expert) pairs are first sorted by expert, so each
expert's matrix is read once for all the positions that chose it.

Routers (``ModelArgs.router_scoring``):
- ``softmax``: softmax over all experts, keep the top k; ``norm_topk_prob`` renormalises
  the k kept weights to sum to 1 (Mixtral always does; Qwen-MoE and OLMoE by config).
- ``topk_softmax``: the top k logits, softmax over those k (gpt-oss).
- ``topk_sigmoid``: the top k logits, each weight the sigmoid of its logit (Llama 4, whose
  weights scale the experts' inputs: ``router_scales_input``).
- ``sigmoid``: sigmoid scores; the choice adds a learned per-expert bias
  (``e_score_correction_bias``) and may first keep the best ``topk_group`` of ``n_group``
  expert groups; the weights are the unbiased scores, optionally renormalised, times
  ``routed_scaling_factor`` (DeepSeek-V3, GLM-4.5). ``router_choice_bias`` adds the same
  bias to a softmax router's choice (ERNIE 4.5 MoE).
- ``sparsemixer``: PhiMoE's: k rounds of the best untaken expert, each weighted by its
  softmax within a band of logits near it (``router_jitter_eps``).
Experts whose scores tie are taken in index order (lower index first).

This file holds only math, like ``model.py``, which builds these blocks (and passes in the
shared expert and the activation, so nothing here imports the model). On MLX's CPU backend
the experts take the routes of ``mlx_tfm/cpu/experts.py`` behind the one switch.

Shapes: B batch, L positions, D hidden size, E experts, k experts per position,
F an expert's intermediate size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import mlx.nn as nn

from ..cpu import experts as cpu_experts
from ..cpu import on_cpu

if TYPE_CHECKING:
    from .config import ModelArgs

ROUTER_SCORINGS = ("softmax", "topk_softmax", "sigmoid", "topk_sigmoid", "sparsemixer")
# From this many (position, expert) pairs on, the pairs are sorted by expert first (as mlx-lm).
SORT_FROM_PAIRS = 64


# -- routing ---------------------------------------------------------------------------


def top_k_indices(scores: mx.array, k: int) -> mx.array:
    """The k best experts of each position, best first; ties in index order. (..., E) -> (..., k)"""
    # argsort is stable, so equal scores keep their index order.
    return mx.stop_gradient(mx.argsort(-scores, axis=-1)[..., :k]).astype(mx.uint32)


def limit_to_groups(choice: mx.array, n_group: int, topk_group: int) -> mx.array:
    """DeepSeek-V3's group-limited choice: experts are split into ``n_group`` equal groups,
    a group scores the sum of its two best experts, and only the best ``topk_group`` groups'
    experts stay eligible (the others get -inf)."""
    *lead, E = choice.shape
    groups = choice.reshape(*lead, n_group, E // n_group)  # (..., n_group, E / n_group)
    best_two = mx.sort(groups, axis=-1)[..., -2:].sum(axis=-1)  # (..., n_group)
    dropped = mx.argsort(-best_two, axis=-1)[..., topk_group:]
    keep = mx.ones(best_two.shape, dtype=mx.bool_)
    keep = mx.put_along_axis(keep, dropped, mx.array(False), axis=-1)
    return mx.where(mx.repeat(keep, E // n_group, axis=-1), choice, -mx.inf)


def sparsemixer(logits: mx.array, k: int, jitter_eps: float) -> tuple[mx.array, mx.array]:
    """PhiMoE's router at inference: k rounds, each taking the best expert not yet taken;
    its weight is its softmax among the untaken experts whose logit lies within a relative
    band of ``2 * jitter_eps`` of it (|logit| floored at the best one's, as the scale).
    (..., E) -> (indices (..., k) uint32, weights (..., k) float32)"""
    untaken = logits
    indices, weights = [], []
    for _ in range(k):
        best = untaken.max(axis=-1, keepdims=True)  # (..., 1)
        index = mx.argmax(untaken, axis=-1, keepdims=True)
        outside = (best - logits) / mx.maximum(mx.abs(logits), best) > 2 * jitter_eps
        band = mx.softmax(mx.where(outside, -mx.inf, untaken), axis=-1, precise=True)
        indices.append(index)
        weights.append(mx.take_along_axis(band, index, axis=-1))
        untaken = mx.put_along_axis(untaken, index, mx.array(-mx.inf, untaken.dtype), axis=-1)
    return mx.stop_gradient(mx.concatenate(indices, axis=-1)).astype(mx.uint32), mx.concatenate(weights, axis=-1)


def route(logits: mx.array, args: "ModelArgs", score_bias: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Router logits (..., E) -> (indices (..., k) uint32, weights (..., k) float32)."""
    k = args.num_experts_per_tok
    logits = logits.astype(mx.float32)
    if args.router_scoring == "sparsemixer":
        return sparsemixer(logits, k, args.router_jitter_eps)
    if args.router_scoring == "topk_softmax":
        indices = top_k_indices(logits, k)
        return indices, mx.softmax(mx.take_along_axis(logits, indices, axis=-1), axis=-1, precise=True)
    if args.router_scoring == "topk_sigmoid":
        indices = top_k_indices(logits, k)
        return indices, mx.sigmoid(mx.take_along_axis(logits, indices, axis=-1))
    if args.router_scoring == "softmax":
        scores = mx.softmax(logits, axis=-1, precise=True)
        choice = scores + score_bias.astype(mx.float32) if args.router_choice_bias else scores
    else:  # sigmoid
        scores = mx.sigmoid(logits)
        choice = scores + score_bias.astype(mx.float32)
        if args.n_group > 1:
            choice = limit_to_groups(choice, args.n_group, args.topk_group)
    indices = top_k_indices(choice, k)
    weights = mx.take_along_axis(scores, indices, axis=-1)
    if args.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + (1e-20 if args.router_scoring == "sigmoid" else 0))
    if args.routed_scaling_factor != 1.0:
        weights = weights * args.routed_scaling_factor
    return indices, weights


# -- stacked experts -------------------------------------------------------------------


class SwitchLinear(nn.Module):
    """``num_experts`` linear layers stored as one (num_experts, out, in) weight; each
    position is multiplied by the experts ``indices`` names."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def output_dims(self) -> int:
        return self.weight.shape[1]

    @property
    def input_dims(self) -> int:
        return self.weight.shape[2]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (..., 1, in) rows, indices (...) -> (..., 1, out)."""
        y = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y

    def to_quantized(self, group_size: int | None = None, bits: int | None = None, mode: str = "affine"):
        return QuantizedSwitchLinear.from_switch_linear(self, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """``SwitchLinear`` with each expert's matrix quantized (``mx.quantize``: affine, or
    MXFP4's 4-bit floats with a shared power-of-two scale per 32 values). Built from the
    float (num_experts, out, in) ``weight``; a checkpoint's packed arrays replace these."""

    def __init__(self, weight: mx.array, group_size: int | None = None, bits: int | None = None,
                 mode: str = "affine", bias: mx.array | None = None):
        super().__init__()
        self.group_size, self.bits = quantization_defaults(mode, group_size, bits)
        self.mode = mode
        self.weight, self.scales, *biases = mx.quantize(weight, self.group_size, self.bits, mode=mode)
        if biases:  # affine only
            self.biases = biases[0]
        if bias is not None:
            self.bias = bias
        self.freeze()

    @classmethod
    def from_switch_linear(cls, layer: SwitchLinear, group_size: int | None, bits: int | None, mode: str):
        return cls(layer.weight, group_size, bits, mode, layer.get("bias"))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def output_dims(self) -> int:
        return self.weight.shape[1]

    @property
    def input_dims(self) -> int:
        return self.weight.shape[2] * 32 // self.bits

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices, transpose=True,
                          group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices)
        return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y

    def dense_weight(self) -> mx.array:
        """The (num_experts, out, in) float weight."""
        return mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                             bits=self.bits, mode=self.mode)


def quantization_defaults(mode: str, group_size: int | None, bits: int | None) -> tuple[int, int]:
    """MLX's defaults per mode where a setting is left out."""
    default_group, default_bits = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}[mode]
    return group_size or default_group, bits or default_bits


def clamped_swiglu(alpha: float, limit: float) -> Callable[[mx.array, mx.array], mx.array]:
    """gpt-oss's gated unit: ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, limit)``."""

    def activation(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1) * (gate * mx.sigmoid(alpha * gate))

    return mx.compile(activation, shapeless=True)


def sort_by_expert(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Rows of x repeated per chosen expert and ordered by expert, with the sorted indices
    and the order that undoes the sort. x (N, 1, 1, D), indices (N, k) ->
    (N * k, 1, D), (N * k,), (N * k,)"""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], mx.argsort(order)


class SwitchGLU(nn.Module):
    """The experts: a gated FFN per expert, ``down(act(gate(x), up(x)))``, as three
    ``SwitchLinear``s."""

    def __init__(self, dims: int, hidden_dims: int, num_experts: int, activation, bias: bool = False):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden_dims, num_experts, bias)
        self.up_proj = SwitchLinear(dims, hidden_dims, num_experts, bias)
        self.down_proj = SwitchLinear(hidden_dims, dims, num_experts, bias)
        self.activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (..., D), indices (..., k) -> each chosen expert's output (..., k, D)."""
        indices = mx.stop_gradient(indices)
        if on_cpu() and cpu_experts.takes(self, indices):
            return cpu_experts.switch_glu(self, x, indices)
        return through_experts(x, indices, self._expert_ffn)

    def _expert_ffn(self, rows: mx.array, chosen: mx.array, sort: bool) -> mx.array:
        hidden = self.activation(self.gate_proj(rows, chosen, sort), self.up_proj(rows, chosen, sort))
        return self.down_proj(hidden, chosen, sort)


def through_experts(x: mx.array, indices: mx.array, expert_ffn) -> mx.array:
    """``expert_ffn(rows, chosen, sorted)`` over each position's chosen experts, the pairs
    sorted by expert first when there are many. x (..., D), indices (..., k) -> (..., k, D)."""
    x = mx.expand_dims(x, (-2, -3))  # (..., 1, 1, D): one row, broadcast over the k experts
    sort = indices.size >= SORT_FROM_PAIRS
    if sort:
        rows, chosen, unsort = sort_by_expert(x, indices)  # (N * k, 1, D)
    else:
        rows, chosen = x, indices
    out = expert_ffn(rows, chosen, sort)
    if sort:
        out = mx.unflatten(out[unsort], 0, indices.shape)  # (N * k, 1, D) -> (..., k, 1, D)
    return out.squeeze(-2)


class SwitchMLP(nn.Module):
    """Ungated experts (Nemotron-H): ``down(act(up(x)))`` per expert, two ``SwitchLinear``s.
    They take the plain MLX route on every device (the CPU route is for gated experts)."""

    def __init__(self, dims: int, hidden_dims: int, num_experts: int, activation, bias: bool = False):
        super().__init__()
        self.up_proj = SwitchLinear(dims, hidden_dims, num_experts, bias)
        self.down_proj = SwitchLinear(hidden_dims, dims, num_experts, bias)
        self.activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (..., D), indices (..., k) -> each chosen expert's output (..., k, D)."""
        return through_experts(x, mx.stop_gradient(indices), self._expert_ffn)

    def _expert_ffn(self, rows: mx.array, chosen: mx.array, sort: bool) -> mx.array:
        return self.down_proj(self.activation(self.up_proj(rows, chosen, sort)), chosen, sort)


class SparseMoeBlock(nn.Module):
    """Router, stacked experts (gated, or with ``ungated_experts`` up/down only) and an
    optional shared expert (Qwen2-MoE: a dense FFN every position passes through, scaled
    by ``sigmoid(shared_expert_gate(x))``)."""

    def __init__(self, args: "ModelArgs", activation, shared_expert: nn.Module | None = None):
        super().__init__()
        if args.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"unknown router_scoring {args.router_scoring!r} ({', '.join(ROUTER_SCORINGS)})")
        self.args = args
        D, E = args.hidden_size, args.num_experts
        self.gate = nn.Linear(D, E, bias=args.router_bias)
        if args.router_scoring == "sigmoid" or args.router_choice_bias:
            self.e_score_correction_bias = mx.zeros((E,))
        # ungated experts take a one-argument activation, act(up(x)); gated ones act(gate, up)
        experts = SwitchMLP if args.ungated_experts else SwitchGLU
        self.switch_mlp = experts(D, args.moe_intermediate_size, E, activation, bias=args.expert_bias)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            if args.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = route(self.gate(x), self.args, self.get("e_score_correction_bias"))
        if self.args.router_scales_input:
            y = self._experts_of_scaled_inputs(x, indices, weights)
        else:
            experts = self.switch_mlp(x, indices)  # (..., k, D)
            y = (experts * weights[..., None].astype(experts.dtype)).sum(axis=-2)
        if "shared_expert" in self:
            shared = self.shared_expert(x)
            if "shared_expert_gate" in self:
                shared = mx.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        return y

    def _experts_of_scaled_inputs(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        """Llama 4: each chosen expert reads x times its weight, sum_j expert_j(w_j x); the
        experts are not linear, so that differs from weighting their outputs."""
        scaled = x[..., None, :] * weights[..., None].astype(x.dtype)  # (..., k, D): one input per expert
        experts = self.switch_mlp(scaled, indices[..., None])  # each row its one expert: (..., k, 1, D)
        return experts.squeeze(-2).sum(axis=-2)


__all__ = ["SparseMoeBlock", "SwitchGLU", "SwitchMLP", "SwitchLinear", "QuantizedSwitchLinear", "route", "clamped_swiglu"]
