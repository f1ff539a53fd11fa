"""Which tensors two models differ in, and by how much.

Per tensor, the relative change ``||B - A||_F / ||A||_F``; per block, the same over all its
tensors together (sqrt of the summed squares). A quantized model compares by its
dequantized weights, what it computes with: a quantized copy shows its rounding error, a
LoRA-fused copy the update in exactly the layers it adapted. Tensors are compared one at
a time in float32, so two large models never need a float32 copy each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError
from ..weights.quantization import dequantize_weights
from .parts import BLOCK, QUANTIZATION_ARRAYS, arrays_by_module, is_quantized


def relative_change(norm: float, change: float) -> float:
    """||B - A|| / ||A||; infinite when A is zero and B is not."""
    if norm > 0:
        return change / norm
    return 0.0 if change == 0 else math.inf


@dataclass(frozen=True)
class TensorChange:
    name: str
    layer: int | None
    shape: tuple[int, ...]
    norm: float  # ||A||_F
    change: float  # ||B - A||_F

    @property
    def relative(self) -> float:
        return relative_change(self.norm, self.change)

    @property
    def part(self) -> str:
        """Its name within its block (``mlp.down_proj.weight``), the same in every block, or
        "outside the blocks"."""
        match = BLOCK.fullmatch(self.name)
        return match.group(2) if match else OUTSIDE_THE_BLOCKS


OUTSIDE_THE_BLOCKS = "outside the blocks"


def dense_tensors(model: nn.Module) -> dict[str, mx.array]:
    """Every tensor by name as the model computes with it, lazily (nothing is computed
    here): a quantized module's ``weight`` dequantized, its scales and biases folded in."""
    modules = dict(model.named_modules())
    tensors = {}
    for path, arrays in arrays_by_module(model).items():
        names = {key: f"{path}.{key}" for key in arrays}
        if is_quantized(arrays):
            module = modules[path]
            quantization = {"group_size": module.group_size, "bits": module.bits}
            quantized = {names[key]: arrays[key] for key in ("weight", *QUANTIZATION_ARRAYS)}
            tensors.update(dequantize_weights(quantized, quantization, mx.float32))
            tensors.update({names[k]: v for k, v in arrays.items() if k not in ("weight", *QUANTIZATION_ARRAYS)})
        else:
            tensors.update({names[k]: v for k, v in arrays.items()})
    return tensors


def first_mismatch(a: dict[str, mx.array], b: dict[str, mx.array], labels: tuple[str, str]) -> str | None:
    """The first tensor (in A's order) that B lacks or has in another shape, else the
    first that only B has; None when the two have the same tensors and shapes."""
    for name, tensor in a.items():
        if name not in b:
            return f"{name} is in {labels[0]} but not in {labels[1]}"
        if tensor.shape != b[name].shape:
            return f"{name} is {tuple(tensor.shape)} in {labels[0]} but {tuple(b[name].shape)} in {labels[1]}"
    extra = next((name for name in b if name not in a), None)
    return None if extra is None else f"{extra} is in {labels[1]} but not in {labels[0]}"


def compare_models(a: nn.Module, b: nn.Module, labels: tuple[str, str] = ("A", "B")) -> list[TensorChange]:
    """Every tensor's change from ``a`` to ``b``, in ``a``'s order; a UserError naming the
    first mismatch when their tensors or shapes differ."""
    dense_a, dense_b = dense_tensors(a), dense_tensors(b)
    mismatch = first_mismatch(dense_a, dense_b, labels)
    if mismatch:
        raise UserError(f"cannot compare the two models: {mismatch}")
    changes = []
    for name, tensor in dense_a.items():
        before, after = tensor.astype(mx.float32).flatten(), dense_b[name].astype(mx.float32).flatten()
        norm, change = mx.linalg.norm(before), mx.linalg.norm(after - before)
        mx.eval(norm, change)
        match = BLOCK.fullmatch(name.rpartition(".")[0])
        changes.append(TensorChange(name, int(match.group(1)) if match else None, tuple(tensor.shape),
                                    norm.item(), change.item()))
    return changes


@dataclass(frozen=True)
class GroupChange:
    layer: int | None  # None: the tensors outside the blocks
    norm: float
    change: float

    @property
    def relative(self) -> float:
        return relative_change(self.norm, self.change)


def layer_changes(changes: list[TensorChange]) -> list[GroupChange]:
    """Per block (then the tensors outside the blocks): sqrt(sum ||dW||²) / sqrt(sum ||W||²)."""
    layers = sorted({c.layer for c in changes if c.layer is not None}) + [None]
    groups = []
    for layer in layers:
        members = [c for c in changes if c.layer == layer]
        if members:
            groups.append(GroupChange(layer, math.sqrt(sum(c.norm**2 for c in members)),
                                      math.sqrt(sum(c.change**2 for c in members))))
    return groups


__all__ = ["TensorChange", "GroupChange", "dense_tensors", "compare_models", "layer_changes"]
