"""Experts beside the dense MLP (Gemma 4's mixture of experts): each block keeps its
dense FFN and adds routed experts next to it. The router reads the block's residual
stream (RMS-normed without a weight, times a learned scale and 1/sqrt(D)), picks the top
k of a softmax, renormalises them and scales each by its expert's learned factor; the
experts read their own norm of the stream. The two outputs are normed apart and summed
before the block's last FFN norm.

Parameter names follow the checkpoints (mlx-lm's layout): ``router.proj``, ``router.scale``,
``router.per_expert_scale``, ``experts.switch_glu.{gate,up,down}_proj`` and the norms
``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_1``, ``post_feedforward_layernorm_2``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .experts import SwitchGLU, top_k_indices
from .layers import gated_activation, make_norm

NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")


class ExpertRouter(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        D, E = args.hidden_size, args.experts_beside_mlp
        self.proj = nn.Linear(D, E, bias=False)
        self.scale = mx.ones((D,))
        self.per_expert_scale = mx.ones((E,))
        self.eps, self.k = args.norm_eps, args.num_experts_per_tok

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (..., D) -> the chosen experts (..., k) and their weights (..., k) float32."""
        normed = mx.fast.rms_norm(x, None, self.eps) * self.scale * (x.shape[-1] ** -0.5)
        probabilities = mx.softmax(self.proj(normed).astype(mx.float32), axis=-1, precise=True)
        indices = top_k_indices(probabilities, self.k)
        weights = mx.take_along_axis(probabilities, indices, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return indices, weights * self.per_expert_scale[indices].astype(mx.float32)


class BesideExperts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.experts_beside_mlp,
                                    gated_activation(args.hidden_act))


def add_modules(block: nn.Module, args: ModelArgs) -> None:
    """The router, the experts and their three norms, as the block's own attributes."""
    block.router = ExpertRouter(args)
    block.experts = BesideExperts(args)
    for name in NORMS:
        setattr(block, name, make_norm(args))


def with_experts(block: nn.Module, h: mx.array, dense: mx.array) -> mx.array:
    """The block's stream h (B, L, D) and its dense FFN's output (B, L, D) -> the two
    sides' normed sum (B, L, D)."""
    indices, weights = block.router(h)
    routed = block.experts.switch_glu(block.pre_feedforward_layernorm_2(h), indices)  # (B, L, k, D)
    routed = (routed * weights[..., None].astype(routed.dtype)).sum(axis=-2)
    return block.post_feedforward_layernorm_1(dense) + block.post_feedforward_layernorm_2(routed)
