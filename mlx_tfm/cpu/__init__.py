"""Routes that make MLX's CPU backend fast, in one place behind one switch.

- ``switch``: ``on_cpu()``, asked by every route at call time; ``generic_routes()`` turns
  them off (tests run the plain MLX routes, what Metal and CUDA run, against them).
- ``linear``: linear, quantized linear and embedding layers whose products take the faster
  CPU path (float32 BLAS by blocks, rows split over CPU streams, ``W @ x``).
- ``attention``: the fused attention op over blocks of queries; a decoding step's through
  mlx_tfm's kernel.
- ``switch`` also holds ``int8_activations()``: the quantized decoding products with their
  input rounded to int8 and integer dot products (off unless asked for).
- ``pointwise``: RMSNorm, RoPE, SwiGLU's ``silu(gate) * up`` and the log-sum-exp over the
  vocabulary, one kernel call each.

``specialize(model)`` is the one step that swaps the CPU layers in: applied when a model
is loaded, after it is quantized and after adapters are fused. The swapped layers hold the
same arrays and are the plain MLX layers whenever the switch is off.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .kernels import kernels as loaded_kernels  # not `kernels`: that name is the subpackage
from .linear import Embedding, Linear, QuantizedEmbedding, QuantizedLinear
from .switch import generic_routes, int8_activations, on_cpu, routes_enabled


def _specialized(path: str, module: nn.Module) -> nn.Module:
    kind = type(module)
    if kind is nn.Linear:
        return Linear.from_linear(module)
    if kind is nn.Embedding:
        return Embedding.from_embedding(module)
    if kind is nn.QuantizedLinear:
        return QuantizedLinear.from_quantized(module)
    if kind is nn.QuantizedEmbedding:
        return QuantizedEmbedding.from_quantized(module)
    return module


def specialize(model: nn.Module) -> nn.Module:
    """Swap the CPU-route layers in for the model's plain MLX linear and embedding layers
    (exact types only: LoRA wrappers and other subclasses keep theirs). Returns ``model``.
    A bad ``MLX_TFM_KERNELS_ISA`` or ``MLX_TFM_INT8_ACTIVATIONS`` is a UserError here, as the
    model is loaded, rather than at its first product."""
    loaded_kernels()
    int8_activations()
    leaves = tree_map_with_path(_specialized, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    return model


__all__ = ["on_cpu", "generic_routes", "int8_activations", "routes_enabled", "specialize"]
