"""Projectors: a vision tower's outputs -> embeddings of the language model's width, one
row per image token the prompt holds.

- ``MLPProjector`` (LLaVA): the tower's hidden states (class token dropped by the
  "default" strategy), linear_1 -> activation -> linear_2;
- ``PixelShuffleProjector`` (Idefics3, SmolVLM): each s x s block of patches folded into
  one token of s*s times the width, then one linear map (``modality_projection.proj``);
- ``AveragePoolProjector`` (Gemma 3): the patch grid averaged in k x k blocks down to
  ``tokens_per_image``, an RMSNorm scaling by (1 + weight), then a matmul.

``make_projector(vision, tower, text)`` builds the one ``vision.projector`` names (from
``VisionArgs``, the tower's and the language model's ``ModelArgs``); every projector is
``projector(tower_states (N, P, D_vision)) -> (N, T, D_text)``.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .layers import ACTIVATIONS, RMSNorm
from .vision_args import VisionArgs

PROJECTORS = ("mlp", "pixel_shuffle", "average_pool")


class MLPProjector(nn.Module):
    def __init__(self, vision: VisionArgs, tower: ModelArgs, text: ModelArgs):
        super().__init__()
        self.drop_class_token = vision.vision_feature_select == "default"
        self.linear_1 = nn.Linear(tower.hidden_size, text.hidden_size, bias=vision.projector_bias)
        self.act = ACTIVATIONS[vision.projector_act]
        self.linear_2 = nn.Linear(text.hidden_size, text.hidden_size, bias=vision.projector_bias)

    def __call__(self, states: mx.array) -> mx.array:
        if self.drop_class_token:
            states = states[:, 1:]
        return self.linear_2(self.act(self.linear_1(states)))


def pixel_shuffle(states: mx.array, scale: int) -> mx.array:
    """(N, P, D) -> (N, P / s^2, D * s^2): each s x s block of the square patch grid as one
    token, its patches' features side by side in transformers' order."""
    N, P, D = states.shape
    side = math.isqrt(P)
    # (N, side, side, D) -> (N, side, side / s, D * s): s neighbours in a row side by side
    x = states.reshape(N, side, side // scale, D * scale)
    # -> (N, side / s, side, D * s) -> (N, side / s, side / s, D * s * s): then s rows
    x = x.transpose(0, 2, 1, 3).reshape(N, side // scale, side // scale, D * scale * scale)
    # back to row-major blocks, (N, P / s^2, D * s^2)
    return x.transpose(0, 2, 1, 3).reshape(N, P // (scale * scale), D * scale * scale)


class ModalityProjection(nn.Module):
    def __init__(self, in_dims: int, out_dims: int):
        super().__init__()
        self.proj = nn.Linear(in_dims, out_dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


class PixelShuffleProjector(nn.Module):
    def __init__(self, vision: VisionArgs, tower: ModelArgs, text: ModelArgs):
        super().__init__()
        self.scale = vision.projector_scale
        self.modality_projection = ModalityProjection(tower.hidden_size * self.scale ** 2, text.hidden_size)

    def __call__(self, states: mx.array) -> mx.array:
        return self.modality_projection(pixel_shuffle(states, self.scale))


class AveragePoolProjector(nn.Module):
    def __init__(self, vision: VisionArgs, tower: ModelArgs, text: ModelArgs):
        super().__init__()
        self.side = vision.grid_side
        tokens_side = math.isqrt(vision.tokens_per_image)
        if tokens_side * tokens_side != vision.tokens_per_image or self.side % tokens_side:
            raise ValueError(f"{vision.tokens_per_image} tokens per image do not pool a {self.side}x{self.side} grid")
        self.kernel = self.side // tokens_side
        self.mm_soft_emb_norm = RMSNorm(tower.hidden_size, tower.norm_eps, weight_offset=1.0)
        self.mm_input_projection_weight = mx.zeros((tower.hidden_size, text.hidden_size))

    def __call__(self, states: mx.array) -> mx.array:
        N, P, D = states.shape
        k, out_side = self.kernel, self.side // self.kernel
        # (N, side, side, D) -> (N, out_side, k, out_side, k, D): the k x k blocks to average
        blocks = states.reshape(N, out_side, k, out_side, k, D)
        pooled = blocks.mean(axis=(2, 4)).reshape(N, out_side * out_side, D)  # (N, T, D)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight.astype(pooled.dtype)


def make_projector(vision: VisionArgs, tower: ModelArgs, text: ModelArgs) -> nn.Module:
    """The projector ``vision.projector`` names, from the tower's width to the text model's."""
    kinds = {"mlp": MLPProjector, "pixel_shuffle": PixelShuffleProjector, "average_pool": AveragePoolProjector}
    if vision.projector not in kinds:
        raise ValueError(f"unknown projector {vision.projector!r} ({', '.join(PROJECTORS)})")
    return kinds[vision.projector](vision, tower, text)
