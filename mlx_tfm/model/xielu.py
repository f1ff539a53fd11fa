"""xIELU (Apertus): an activation with two learned parameters per layer,

    xielu(x) = alpha_p x^2 + beta x                           for x > 0
               alpha_n (expm1(min(x, eps)) - x) + beta x      otherwise

with ``alpha_p = softplus(a_p)`` and ``alpha_n = beta + softplus(a_n)``, so both stay
positive while training moves ``a_p`` and ``a_n``. The parameters are named as in
transformers' ``XIELUActivation`` (``mlp.act_fn.alpha_p`` ...), so checkpoints load by copy.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


def inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


class XIELU(nn.Module):
    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        self.alpha_p = mx.array([inverse_softplus(alpha_p_init)])  # (1,) as transformers stores it
        self.alpha_n = mx.array([inverse_softplus(alpha_n_init - beta)])
        self.beta = mx.array(beta)  # fixed: buffers in transformers, frozen here
        self.eps = mx.array(eps)
        self.freeze(keys=["beta", "eps"])

    def __call__(self, x: mx.array) -> mx.array:
        alpha_p = nn.softplus(self.alpha_p).astype(x.dtype)
        alpha_n = (self.beta + nn.softplus(self.alpha_n)).astype(x.dtype)
        beta = self.beta.astype(x.dtype)
        negative = (mx.expm1(mx.minimum(x, self.eps.astype(x.dtype))) - x) * alpha_n + beta * x
        return mx.where(x > 0, alpha_p * x * x + beta * x, negative)
