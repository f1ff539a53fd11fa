"""A vision tower (ViT): the seeds' encoder over a sequence of patch embeddings.

An image (C, H, W) is cut into (H / p) x (W / p) patches of p x p pixels; each patch,
flattened channel by channel, goes through one linear map (the patch "convolution", whose
kernel and stride are p, is exactly that matmul over the unfolded patches). CLIP puts a
learned class embedding first. From there it is ``TransformerModel`` of kind "encoder"
fed embedded inputs: learned positions added, CLIP's pre-norm (``embedding_norm``),
bidirectional blocks (LayerNorm, GELU), and SigLIP's post-norm (``final_norm``).

``VisionTower(args, vision)(pixel_values)`` -> (n_views, n_positions, D); every family's
differences are fields: the encoder's ``ModelArgs`` (``embedding_norm``, ``final_norm``,
``hidden_act``, ``norm_eps``...) and the patch embedding's ``VisionArgs`` (``image_size``,
``patch_size``, ``class_token``, ``patch_bias``).

Shapes: N views (images or tiles), C channels, H x W pixels, p patch edge, P patches,
D the tower's width.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .transformer import TransformerModel
from .vision_args import VisionArgs


def unfold_patches(pixel_values: mx.array, patch: int) -> mx.array:
    """(N, C, H, W) -> (N, P, C * p * p): patches row by row, each flattened as the
    convolution kernel (C, p, p) is."""
    N, C, H, W = pixel_values.shape
    rows, cols = H // patch, W // patch
    # (N, C, rows, p, cols, p) -> (N, rows, cols, C, p, p)
    patches = pixel_values.reshape(N, C, rows, patch, cols, patch).transpose(0, 2, 4, 1, 3, 5)
    return patches.reshape(N, rows * cols, C * patch * patch)


class PatchEmbedding(nn.Module):
    """The patch convolution as a matmul: ``weight`` keeps the checkpoint's (D, C, p, p)."""

    def __init__(self, args: ModelArgs, vision: VisionArgs):
        super().__init__()
        p = vision.patch_size
        self.patch_size = p
        self.weight = mx.zeros((args.hidden_size, vision.num_channels, p, p))
        if vision.patch_bias:
            self.bias = mx.zeros((args.hidden_size,))

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """(N, C, H, W) -> (N, P, D)."""
        patches = unfold_patches(pixel_values.astype(self.weight.dtype), self.patch_size)
        out = patches @ self.weight.reshape(self.weight.shape[0], -1).T  # (D, C*p*p) -> transposed
        return out + self.bias if "bias" in self else out


class PatchEmbeddings(nn.Module):
    """Patch embeddings, and CLIP's class embedding in front: ``embeddings.*`` in checkpoints."""

    def __init__(self, args: ModelArgs, vision: VisionArgs):
        super().__init__()
        self.patch_embedding = PatchEmbedding(args, vision)
        if vision.class_token:
            self.class_embedding = mx.zeros((args.hidden_size,))

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """(N, C, H, W) -> (N, P (+1), D)."""
        h = self.patch_embedding(pixel_values)
        if "class_embedding" not in self:
            return h
        N, _, D = h.shape
        cls = mx.broadcast_to(self.class_embedding.astype(h.dtype), (N, 1, D))
        return mx.concatenate([cls, h], axis=1)


def tower_positions(vision: VisionArgs) -> int:
    """Positions the tower's learned table holds: its patches, plus the class token."""
    return vision.grid_side ** 2 + int(vision.class_token)


class VisionTower(nn.Module):
    """``tower(pixel_values (N, C, H, W))`` -> hidden states (N, P (+1), D), the last of
    ``args.num_hidden_layers`` layers (a family reading an earlier layer builds fewer)."""

    def __init__(self, args: ModelArgs, vision: VisionArgs):
        super().__init__()
        if args.kind != "encoder" or args.own_embeddings or args.position_embedding != "learned":
            raise ValueError("a vision tower is kind 'encoder' with learned positions and no token embeddings")
        if args.max_position_embeddings != tower_positions(vision):
            raise ValueError(f"the tower's position table holds {args.max_position_embeddings} positions for "
                             f"{tower_positions(vision)}")
        self.args, self.image_size = args, vision.image_size
        self.embeddings = PatchEmbeddings(args, vision)
        self.encoder = TransformerModel(args)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        size = self.image_size
        if pixel_values.shape[-2:] != (size, size):
            raise ValueError(f"the vision tower takes {size}x{size} images, not "
                             f"{pixel_values.shape[-2]}x{pixel_values.shape[-1]}")
        return self.encoder(self.embeddings(pixel_values))
