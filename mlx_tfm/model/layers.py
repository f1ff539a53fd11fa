"""The building blocks every block uses: RMSNorm and LayerNorm, the activations, and the
position-wise feed-forward (gated: SwiGLU, GeGLU; or the classic two-layer form).

Shapes: (B, L, D) in and out; F is the feed-forward's inner width.
"""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import mlx.nn as nn

from ..cpu import linear as cpu_linear
from ..cpu import pointwise as cpu_pointwise
from .config import ModelArgs
from .xielu import XIELU

# -- building blocks ---------------------------------------------------------------


# On MLX's CPU backend the mx.fast norms and RoPE are chains of primitive ops: mlx_tfm's
# kernels take them where they are in use (mlx_tfm/cpu/pointwise.py); otherwise compiling
# fuses each chain into one kernel. On Metal they are single kernels already.
@partial(mx.compile, shapeless=True)
def fused_rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.weight = mx.ones((dims,)) if weight_offset == 0 else mx.zeros((dims,))
        self.eps = eps
        self.weight_offset = weight_offset

    def __call__(self, x: mx.array) -> mx.array:
        weight = self.weight + self.weight_offset if self.weight_offset else self.weight
        if cpu_pointwise.in_use():
            return cpu_pointwise.rms_norm(x, weight, self.eps)
        return fused_rms_norm(x, weight, self.eps)


class OffsetLayerNorm(nn.Module):
    """LayerNorm scaling by (weight + offset): Nemotron's LayerNorm1P stores weight - 1."""

    def __init__(self, dims: int, eps: float, bias: bool, weight_offset: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        if bias:
            self.bias = mx.zeros((dims,))
        self.eps = eps
        self.weight_offset = weight_offset

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.layer_norm(x, self.weight + self.weight_offset, self.get("bias"), self.eps)


def make_norm(args: ModelArgs, dims: int | None = None) -> nn.Module:
    dims = dims or args.hidden_size
    if args.norm_type == "rmsnorm":
        return RMSNorm(dims, args.norm_eps, args.norm_weight_offset)
    if args.norm_type == "layernorm" and args.norm_weight_offset:
        return OffsetLayerNorm(dims, args.norm_eps, args.norm_bias, args.norm_weight_offset)
    if args.norm_type == "layernorm":
        return nn.LayerNorm(dims, eps=args.norm_eps, bias=args.norm_bias)
    raise ValueError(f"unknown norm_type {args.norm_type!r} (rmsnorm, layernorm)")


ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": nn.gelu,  # exact, through erf
    "gelu_tanh": nn.gelu_approx,  # 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))
    "relu": nn.relu,
    "relu2": lambda x: mx.square(nn.relu(x)),  # Primer's squared ReLU (Arcee)
    "quick_gelu": lambda x: x * mx.sigmoid(1.702 * x),  # CLIP's towers (LLaVA)
}


# Activations with learned parameters: a module per MLP, named ``act_fn`` as in checkpoints.
LEARNED_ACTIVATIONS = {"xielu": XIELU}  # Apertus


@lru_cache(maxsize=None)
def gated_activation(name: str):
    """``act(gate) * up`` as one fused kernel."""
    act = ACTIVATIONS[name]
    return mx.compile(lambda gate, up: act(gate) * up, shapeless=True)


class MLP(nn.Module):
    """The position-wise FFN: gated (SwiGLU, GeGLU) or the classic two-layer form."""

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        self.learned_act = args.hidden_act in LEARNED_ACTIVATIONS
        if self.learned_act and args.ffn_gated:
            raise ValueError(f"hidden_act {args.hidden_act!r} is only defined for the ungated MLP")
        if not self.learned_act and args.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unknown hidden_act {args.hidden_act!r} ({', '.join([*ACTIVATIONS, *LEARNED_ACTIVATIONS])})")
        if self.learned_act:
            self.act_fn = LEARNED_ACTIVATIONS[args.hidden_act]()
        else:
            self.act = ACTIVATIONS[args.hidden_act]
        self.gated = args.ffn_gated
        self.gated_act = None if self.learned_act else gated_activation(args.hidden_act)
        self.silu = args.hidden_act == "silu"
        D, F, bias = args.hidden_size, intermediate_size or args.intermediate_size, args.mlp_bias
        if self.gated:
            self.gate_proj = nn.Linear(D, F, bias=bias)
        self.up_proj = nn.Linear(D, F, bias=bias)
        self.down_proj = nn.Linear(F, D, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        if self.gated and self.silu:
            fused = cpu_linear.fused_products((self.gate_proj, self.up_proj), x, gated=True)
            if fused:
                return self.down_proj(fused[0])
        if self.gated and self.silu and cpu_pointwise.in_use():
            return self.down_proj(cpu_pointwise.silu_mul(self.gate_proj(x), self.up_proj(x)))
        if self.gated:
            return self.down_proj(self.gated_act(self.gate_proj(x), self.up_proj(x)))
        act = self.act_fn if self.learned_act else self.act
        return self.down_proj(act(self.up_proj(x)))
