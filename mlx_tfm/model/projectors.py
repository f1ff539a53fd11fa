"""Projectors: a vision tower's outputs -> embeddings of the language model's width, one
row per image token the prompt holds.

- ``MLPProjector`` (LLaVA): the tower's hidden states (class token dropped by the
  "default" strategy), linear_1 -> activation -> linear_2;
- ``PixelShuffleProjector`` (Idefics3, SmolVLM): each s x s block of patches folded into
  one token of s*s times the width, then one linear map (``modality_projection.proj``);
- ``AveragePoolProjector`` (Gemma 3): the patch grid averaged in k x k blocks down to
  ``tokens_per_image``, an RMSNorm scaling by (1 + weight), then a matmul.

``make_projector(args, vision)`` builds the one ``args.projector`` names; every projector
is ``projector(tower_states (N, P, D_vision)) -> (N, T, D_text)``.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .layers import ACTIVATIONS, RMSNorm

PROJECTORS = ("mlp", "pixel_shuffle", "average_pool")


class MLPProjector(nn.Module):
    def __init__(self, args: ModelArgs, vision: ModelArgs):
        super().__init__()
        self.drop_class_token = args.vision_feature_select == "default"
        self.linear_1 = nn.Linear(vision.hidden_size, args.hidden_size, bias=args.projector_bias)
        self.act = ACTIVATIONS[args.projector_act]
        self.linear_2 = nn.Linear(args.hidden_size, args.hidden_size, bias=args.projector_bias)

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
    def __init__(self, args: ModelArgs, vision: ModelArgs):
        super().__init__()
        self.scale = args.projector_scale
        self.modality_projection = ModalityProjection(vision.hidden_size * self.scale ** 2, args.hidden_size)

    def __call__(self, states: mx.array) -> mx.array:
        return self.modality_projection(pixel_shuffle(states, self.scale))


class AveragePoolProjector(nn.Module):
    def __init__(self, args: ModelArgs, vision: ModelArgs):
        super().__init__()
        self.side = vision.image_size // vision.patch_size
        tokens_side = math.isqrt(args.tokens_per_image)
        if tokens_side * tokens_side != args.tokens_per_image or self.side % tokens_side:
            raise ValueError(f"{args.tokens_per_image} tokens per image do not pool a {self.side}x{self.side} grid")
        self.kernel = self.side // tokens_side
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.norm_eps, weight_offset=1.0)
        self.mm_input_projection_weight = mx.zeros((vision.hidden_size, args.hidden_size))

    def __call__(self, states: mx.array) -> mx.array:
        N, P, D = states.shape
        k, out_side = self.kernel, self.side // self.kernel
        # (N, side, side, D) -> (N, out_side, k, out_side, k, D): the k x k blocks to average
        blocks = states.reshape(N, out_side, k, out_side, k, D)
        pooled = blocks.mean(axis=(2, 4)).reshape(N, out_side * out_side, D)  # (N, T, D)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight.astype(pooled.dtype)


def make_projector(args: ModelArgs, vision: ModelArgs) -> nn.Module:
    """The projector ``args.projector`` names, from the tower's width to the text model's."""
    if args.projector == "mlp":
        return MLPProjector(args, vision)
    if args.projector == "pixel_shuffle":
        return PixelShuffleProjector(args, vision)
    if args.projector == "average_pool":
        return AveragePoolProjector(args, vision)
    raise ValueError(f"unknown projector {args.projector!r} ({', '.join(PROJECTORS)})")
