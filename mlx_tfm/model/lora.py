"""LoRA and DoRA as module surgery: ``apply_lora`` swaps adapters in, ``fuse_adapters``
folds them back into plain (or re-quantized) layers.

LoRA (Hu et al. 2021) keeps a linear layer's weight W (out, in) frozen and learns a
low-rank update: ``y = x W^T + scale * (x A) B`` with A (in, r), B (r, out). B starts at
zero, so a fresh adapter leaves the model's outputs unchanged. DoRA (Liu et al. 2024)
also learns a per-output magnitude m: ``y = m / ||W + scale B^T A^T||_row * (x W'^T)``.
A quantized base (QLoRA) works the same way: only A, B (and m) are trained. Stacked
experts (``mlx_tfm.model.experts.SwitchLinear``) get one A (r, in) and B (out, r) per
expert, as mlx-lm's ``LoRASwitchLinear``; DoRA is not defined for them (nor in mlx-lm).

Parameter names follow mlx-lm (``lora_a``, ``lora_b``, ``m``, ``linear``), so adapters
move between the two (files: ``mlx_tfm.weights.adapters``).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..cpu import specialize
from ..errors import UserError
from .experts import QuantizedSwitchLinear, SwitchLinear

FINE_TUNE_TYPES = ("lora", "dora", "full")
LORA_DEFAULTS = {"rank": 8, "scale": 20.0, "dropout": 0.0}


def dense_weight(linear: nn.Module) -> mx.array:
    """The float weight of a Linear or a QuantizedLinear (out, in), or of stacked experts
    (experts, out, in)."""
    if isinstance(linear, QuantizedSwitchLinear):
        return linear.dense_weight()
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.get("biases"),
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    return linear.weight


def linear_dims(linear: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims); a quantized weight packs 32 // bits values per uint32."""
    out_dims, packed = linear.weight.shape
    in_dims = packed * 32 // linear.bits if isinstance(linear, nn.QuantizedLinear) else packed
    return in_dims, out_dims


class LoRALinear(nn.Module):
    @classmethod
    def from_base(cls, linear: nn.Module, rank: int = 8, scale: float = 20.0, dropout: float = 0.0):
        in_dims, out_dims = linear_dims(linear)
        lora = cls(in_dims, out_dims, rank, scale, dropout)
        lora.linear = linear
        return lora

    def __init__(self, input_dims: int, output_dims: int, rank: int = 8, scale: float = 20.0, dropout: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(input_dims, output_dims, bias=False)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        bound = 1.0 / math.sqrt(input_dims)
        self.lora_a = mx.random.uniform(-bound, bound, (input_dims, rank))
        self.lora_b = mx.zeros((rank, output_dims))

    def delta(self) -> mx.array:
        """The update this adapter adds to the (out, in) weight."""
        return self.scale * (self.lora_b.T @ self.lora_a.T).astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """The plain (or re-quantized) linear layer with the update folded into W."""
        weight = dense_weight(self.linear)
        fused = (weight.astype(mx.float32) + self.delta()).astype(weight.dtype)
        return _rebuild(self.linear, fused, dequantize)


class DoRALinear(LoRALinear):
    def __init__(self, input_dims: int, output_dims: int, rank: int = 8, scale: float = 20.0, dropout: float = 0.0):
        super().__init__(input_dims, output_dims, rank, scale, dropout)
        self.m = mx.ones((output_dims,))

    @classmethod
    def from_base(cls, linear: nn.Module, rank: int = 8, scale: float = 20.0, dropout: float = 0.0):
        dora = super().from_base(linear, rank, scale, dropout)
        dora.m = mx.linalg.norm(dense_weight(linear).astype(mx.float32), axis=1)
        return dora

    def _adapted_weight(self) -> mx.array:
        return dense_weight(self.linear).astype(mx.float32) + self.delta()

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.linear.get("bias")
        y = self.linear(x)
        if bias is not None:
            y = y - bias
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        y = y + (self.scale * z).astype(x.dtype)
        # Rescale each output row to the learned magnitude; the norm carries no gradient
        # (the DoRA paper's memory-saving choice, which mlx-lm also makes).
        norm = mx.stop_gradient(mx.linalg.norm(self._adapted_weight(), axis=1))
        y = (self.m / norm).astype(x.dtype) * y
        return y if bias is None else y + bias

    def fuse(self, dequantize: bool = False) -> nn.Module:
        weight = self._adapted_weight()
        fused = (self.m / mx.linalg.norm(weight, axis=1))[:, None] * weight
        return _rebuild(self.linear, fused.astype(dense_weight(self.linear).dtype), dequantize)


def _rebuild(base: nn.Module, weight: mx.array, dequantize: bool) -> nn.Module:
    out_dims, in_dims = weight.shape
    bias = base.get("bias")
    linear = nn.Linear(in_dims, out_dims, bias=bias is not None)
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    if isinstance(base, nn.QuantizedLinear) and not dequantize:
        return nn.QuantizedLinear.from_linear(linear, base.group_size, base.bits, base.mode)
    return linear


class LoRASwitchLinear(nn.Module):
    """LoRA on stacked experts: ``lora_a`` (experts, r, in), ``lora_b`` (experts, out, r),
    each position updated by its chosen experts' pair (mlx-lm's names and shapes)."""

    @classmethod
    def from_base(cls, layer: nn.Module, rank: int = 8, scale: float = 20.0, dropout: float = 0.0):
        lora = cls(layer.input_dims, layer.output_dims, layer.num_experts, rank, scale, dropout)
        lora.linear = layer
        return lora

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, rank: int = 8, scale: float = 20.0,
                 dropout: float = 0.0):
        super().__init__()
        self.linear = SwitchLinear(input_dims, output_dims, num_experts)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = scale
        bound = 1.0 / math.sqrt(input_dims)
        self.lora_a = mx.random.uniform(-bound, bound, (num_experts, rank, input_dims))
        self.lora_b = mx.zeros((num_experts, output_dims, rank))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.linear(x, indices, sorted_indices)
        z = mx.gather_mm(self.dropout(x), self.lora_a.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)  # (..., 1, r)
        z = mx.gather_mm(z, self.lora_b.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return y + (self.scale * z).astype(x.dtype)

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """The plain (or re-quantized) stacked experts with each expert's update folded in."""
        weight = dense_weight(self.linear)
        delta = self.scale * (self.lora_b @ self.lora_a).astype(mx.float32)  # (experts, out, in)
        return _rebuild_experts(self.linear, (weight.astype(mx.float32) + delta).astype(weight.dtype), dequantize)


def _rebuild_experts(base: nn.Module, weight: mx.array, dequantize: bool) -> nn.Module:
    num_experts, out_dims, in_dims = weight.shape
    layer = SwitchLinear(in_dims, out_dims, num_experts, bias="bias" in base)
    layer.weight = weight
    if "bias" in base:
        layer.bias = base.bias
    if isinstance(base, QuantizedSwitchLinear) and not dequantize:
        return layer.to_quantized(base.group_size, base.bits, base.mode)
    return layer


ADAPTER_CLASSES = {"lora": LoRALinear, "dora": DoRALinear}
LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear)
EXPERT_TYPES = (SwitchLinear, QuantizedSwitchLinear)
QUANTIZED_TYPES = (nn.QuantizedLinear, QuantizedSwitchLinear)


def linear_keys(layers: list[nn.Module]) -> list[str]:
    """Names of the linear layers and stacked experts inside the blocks (a block with
    experts has other ones than a dense block): mlx-lm's default LoRA targets."""
    keys = {name for layer in layers for name, m in layer.named_modules() if isinstance(m, LINEAR_TYPES + EXPERT_TYPES)}
    return sorted(keys)


def adapter_for(module: nn.Module, fine_tune_type: str, rank: int, scale: float, dropout: float) -> nn.Module:
    if isinstance(module, EXPERT_TYPES):
        if fine_tune_type == "dora":
            raise UserError("DoRA is not defined for stacked experts (nor in mlx-lm): use --fine-tune-type lora, "
                            "or keys without the experts")
        return LoRASwitchLinear.from_base(module, rank, scale, dropout)
    return ADAPTER_CLASSES[fine_tune_type].from_base(module, rank, scale, dropout)


def apply_lora(
    model: nn.Module,
    num_layers: int = 16,
    fine_tune_type: str = "lora",
    rank: int = 8,
    scale: float = 20.0,
    dropout: float = 0.0,
    keys: list[str] | None = None,
) -> None:
    """Freeze the model, then make the last ``num_layers`` blocks trainable: adapters on the
    ``keys`` linears (lora, dora) or the whole blocks (full). ``num_layers <= 0``: all."""
    if fine_tune_type not in FINE_TUNE_TYPES:
        raise UserError(f"unknown fine-tune type {fine_tune_type!r} ({', '.join(FINE_TUNE_TYPES)})")
    model.freeze()
    layers = model.layers[-num_layers:] if num_layers > 0 else model.layers
    if fine_tune_type == "full":
        if any(isinstance(m, QUANTIZED_TYPES) for _, m in model.named_modules()):
            raise UserError("full fine-tuning needs a float model; use --fine-tune-type lora for a quantized one")
        for layer in layers:
            layer.unfreeze()
        return
    available = linear_keys(model.layers)
    keys = list(keys) if keys else available
    unknown = sorted(set(keys) - set(available))
    if unknown:
        raise UserError(f"unknown LoRA key(s) {', '.join(unknown)}; the blocks have: {', '.join(available)}")
    for layer in layers:
        modules = dict(layer.named_modules())
        replaced = [(k, adapter_for(modules[k], fine_tune_type, rank, scale, dropout)) for k in keys if k in modules]
        layer.update_modules(tree_unflatten(replaced))


def fuse_adapters(model: nn.Module, dequantize: bool = False) -> None:
    """Replace every adapter by its fused linear layer, in place, specialized for the
    device as a loaded model's layers are (``mlx_tfm.cpu.specialize``)."""
    adapters = (LoRALinear, LoRASwitchLinear)
    fused = [(name, m.fuse(dequantize)) for name, m in model.named_modules() if isinstance(m, adapters)]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dequantize:
        dequantized = [
            (name, _rebuild_experts(m, m.dense_weight(), True) if isinstance(m, QuantizedSwitchLinear)
             else _rebuild(m, dense_weight(m), True))
            for name, m in model.named_modules()
            if isinstance(m, QUANTIZED_TYPES)
        ]
        if dequantized:
            model.update_modules(tree_unflatten(dequantized))
    specialize(model)
