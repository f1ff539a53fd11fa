"""The learning-rate schedule: linear warmup, then cosine decay to a floor.

    lr(step) = peak * step / warmup                                    step <  warmup
    lr(step) = floor + (peak - floor) * (1 + cos(pi * progress)) / 2   afterwards
    progress = (step - warmup) / (total - warmup), clipped to [0, 1]
"""

from __future__ import annotations

import math

import mlx.core as mx


def warmup_cosine(peak: float, total_steps: int, warmup_steps: int = 0, floor: float = 0.0):
    """A schedule ``step -> lr`` that MLX optimizers accept for ``learning_rate``.

    It works on MLX arrays (inside the compiled step) and on Python numbers (for plots).
    """
    decay_steps = max(total_steps - warmup_steps, 1)

    def schedule(step):
        step = mx.array(step, dtype=mx.float32)
        warm = peak * (step + 1) / max(warmup_steps, 1)
        progress = mx.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1.0 + mx.cos(math.pi * progress))
        return mx.where(step < warmup_steps, warm, cosine)

    return schedule


def constant(lr: float):
    """A flat schedule (mlx-lm's default for fine-tuning)."""
    return lambda step: mx.array(lr, dtype=mx.float32)
