"""Stacked experts (``mlx_tfm.model.experts.SwitchGLU``) on MLX's CPU backend.

MLX's CPU ``gather_qmm`` runs on one core and is slow, its ``gather_mm`` takes float32
only, and for a prompt both are far from what float32 BLAS does (measurements: docs/benchmarks.md,
"Mixture of experts"). So on the CPU:

- a few positions (decoding), every projection affine-quantized in a layout mlx_tfm's
  kernels take, or in float16 / bfloat16 (MLX's CPU ``gather_mm`` is float32 only): each
  position's chosen experts are taken out (``mx.take``: k experts, a few hundred KB at 4
  bits) and multiplied by the kernels on every core, or in float32 without them
  (``chosen_experts``);
- a chunk of positions (a prompt): the (position, expert) pairs sorted by expert, and each
  expert's rows multiplied in float32 through BLAS, its weight made float32 just in time a
  block at a time (``by_expert``). Knowing where each expert's rows start takes the counts
  from the device once per layer, which a chunk can afford.

Everything else keeps the plain route: float weights when decoding (``gather_mm`` reads
only the chosen experts and is as fast as anything here for float32), MXFP4 experts, a
model in training mode (its steps are compiled and differentiated: no sync, no kernels)
and experts wrapped in LoRA adapters. The plain route is what Metal and CUDA run; tests run
it against these.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .kernels import kernels
from .linear import DENSE_FROM_ROWS, float32_product, is_half
from .linear import kernels_take as quantized_kernels_take
from .switch import int8_activations

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_quantized(layer: nn.Module) -> bool:
    return "scales" in layer


def takes(glu: nn.Module, indices: mx.array) -> bool:
    """Whether the CPU route computes these experts for these positions."""
    layers = [glu[name] for name in PROJECTIONS]
    # Training (compiled, differentiated) and adapters around the experts take the plain route.
    if glu.training or not all("weight" in layer for layer in layers):
        return False
    if indices.size >= DENSE_FROM_ROWS:
        return True
    return all(kernels_take(layer) if is_quantized(layer) else is_half(layer["weight"]) for layer in layers)


def kernels_take(layer: nn.Module) -> bool:
    return kernels() is not None and layer.mode == "affine" and quantized_kernels_take(layer)


def switch_glu(glu: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """x (..., D), indices (..., k) -> each chosen expert's output (..., k, D)."""
    if indices.size >= DENSE_FROM_ROWS:
        return by_expert(glu, x, indices)
    return chosen_experts(glu, x, indices)


# -- a few positions: the chosen experts' rows taken out -----------------------------------


def taken(layer: nn.Module, experts: mx.array) -> dict[str, mx.array]:
    """The chosen experts' arrays of a stacked layer (weight, scales, biases, bias)."""
    return {name: mx.take(layer[name], experts, axis=0) for name in ("weight", "scales", "biases", "bias")
            if name in layer}


def product(x: mx.array, arrays: dict, layer: nn.Module) -> mx.array:
    """x (..., in) @ W.T for rows W (out, in) of ``layer`` (packed when it is quantized),
    plus the bias rows: mlx_tfm's kernels where they are in use, else in float32."""
    if is_quantized(layer):
        y = kernels().quantized_matvec(x, arrays["weight"], arrays["scales"], arrays["biases"],
                                       group_size=layer.group_size, bits=layer.bits,
                                       int8_activations=int8_activations())
    elif kernels() is not None:
        y = kernels().matvec(x, arrays["weight"])
    else:
        y = x.astype(mx.float32) @ arrays["weight"].astype(mx.float32).T
    return y + arrays["bias"] if "bias" in arrays else y


def one_position(glu: nn.Module, row: mx.array, experts: mx.array) -> mx.array:
    """row (1, D), experts (k,) -> (k, D)."""
    k = experts.size
    up_and_gate = []
    for name in ("gate_proj", "up_proj"):
        layer = glu[name]
        arrays = taken(layer, experts)  # weight (k, F, in) -> (k * F, in): one product for all k
        stacked = {n: a.reshape(k * a.shape[1], *a.shape[2:]) for n, a in arrays.items()}
        up_and_gate.append(product(row, stacked, layer).reshape(k, -1))  # (k, F)
    hidden = glu.activation(*up_and_gate).astype(row.dtype)
    down = glu["down_proj"]
    arrays = taken(down, experts)  # each expert's own hidden row through its own matrix
    return mx.concatenate([product(hidden[j : j + 1], {n: a[j] for n, a in arrays.items()}, down) for j in range(k)])


def chosen_experts(glu: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    k, D = indices.shape[-1], x.shape[-1]
    rows, experts = x.reshape(-1, D), indices.reshape(-1, k)  # (N, D), (N, k)
    outputs = [one_position(glu, rows[n : n + 1], experts[n]) for n in range(rows.shape[0])]
    return mx.stack(outputs).astype(x.dtype).reshape(*indices.shape, D)


# -- a chunk of positions: each expert's rows through float32 BLAS --------------------------


def expert_rows(layer: nn.Module, expert: int):
    """``float32_rows(start, stop, after)`` of one expert's matrix, for ``float32_product``."""

    def float32_rows(start: int, stop: int, after: mx.array) -> mx.array:
        weight = mx.depends(layer["weight"][expert, start:stop], after)
        if not is_quantized(layer):
            return weight.astype(mx.float32)
        scales, biases = layer["scales"][expert, start:stop], layer.get("biases")
        if layer.mode == "affine":  # float32 scales: MLX's CPU dequantize is slow with half ones
            scales = scales.astype(mx.float32)
        return mx.dequantize(
            weight, scales, None if biases is None else biases[expert, start:stop].astype(mx.float32),
            group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
        )

    return float32_rows


def expert_product(rows: mx.array, layer: nn.Module, expert: int) -> mx.array:
    """rows (count, in) @ W_expert.T (+ its bias): for 16-bit experts one call of mlx_tfm's
    kernels (float32 BLAS over blocks of the expert's rows made float32 for a chunk, the
    weight read as stored for a few rows), else float32 blocks of MLX ops."""
    weight = layer["weight"]
    if is_half(weight) and kernels() is not None and kernels().blas_found():
        dense = rows.shape[0] >= DENSE_FROM_ROWS
        y = kernels().matvec(rows, weight[expert], dense=dense).astype(rows.dtype)
    else:
        y = float32_product(rows, expert_rows(layer, expert), weight.shape[1])
    return y + layer["bias"][expert].astype(y.dtype) if "bias" in layer else y


def by_expert(glu: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    k, D = indices.shape[-1], x.shape[-1]
    flat = indices.reshape(-1)  # (N * k,) experts of the pairs, position-major
    order = mx.argsort(flat)
    n_experts = glu["gate_proj"]["weight"].shape[0]
    counts = (flat[None, :] == mx.arange(n_experts, dtype=flat.dtype)[:, None]).sum(axis=1).tolist()  # one sync
    rows = x.reshape(-1, D)[order // k]  # (N * k, D), the pairs sorted by expert
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = rows[start : start + count]
        hidden = glu.activation(expert_product(part, glu["gate_proj"], expert),
                                expert_product(part, glu["up_proj"], expert))
        outputs.append(expert_product(hidden, glu["down_proj"], expert))
        start += count
    sorted_out = mx.concatenate(outputs, axis=0).astype(x.dtype)  # (N * k, D) in expert order
    return sorted_out[mx.argsort(order)].reshape(*indices.shape, D)
