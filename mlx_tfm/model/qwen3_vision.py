"""Qwen3-VL's vision tower: Qwen2-VL's patches, 2D rotary and per-image attention, plus a
learned square grid of position embeddings bilinearly resampled to each image's grid, and
DeepStack: the states after a few chosen blocks, merged like the last ones, go to the
language model too, added to the image tokens' states after its first layers.

The tower returns one array (N / 4, (1 + n_deepstack) * out_hidden_size): the merged
features, then each DeepStack feature side by side, so a prompt's chunks cut all of them
by the same rows; ``split_deepstack`` takes them apart.

Blocks: LayerNorm + linear_fc1 / GELU (tanh) / linear_fc2; mergers: LayerNorm (over one
patch, or over the four a merged patch joins: DeepStack's) + linear_fc1 / GELU / linear_fc2.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserError
from .layers import ACTIVATIONS
from .qwen_vision import (
    PatchEmbed,
    QwenVisionArgs,
    QwenVisionTower,
    VisionAttention,
    image_segments,
    patch_positions,
    segment_batch,
)


def axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (N, 2) into a ``side``-long table and their weights (N, 2) for
    positions ``index`` on axes ``size`` long, the ends aligned with the table's ends."""
    source = index * (side - 1) / np.maximum(size - 1, 1)  # (N,) where each position falls on the table
    floor = np.floor(source)
    taps = np.clip(floor[:, None].astype(np.int64) + np.arange(2), 0, side - 1)  # (N, 2)
    weights = np.clip(1 - np.abs(source[:, None] - floor[:, None] - np.arange(2)), 0, None)
    return taps, weights.astype(np.float32)


def interpolation_plan(grid_thw: np.ndarray, merge_size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """For every patch (in the tower's merge-window order): the four rows of the
    (side * side) position table it mixes (N, 4) and their weights (N, 4)."""
    positions = patch_positions(grid_thw, merge_size)  # (N, 2) rows and columns
    heights = np.repeat(grid_thw[:, 1], grid_thw.prod(axis=1))
    widths = np.repeat(grid_thw[:, 2], grid_thw.prod(axis=1))
    row_taps, row_weights = axis_taps(positions[:, 0].astype(np.float64), heights, side)
    col_taps, col_weights = axis_taps(positions[:, 1].astype(np.float64), widths, side)
    # (N, 2) x (N, 2) -> (N, 2, 2) -> (N, 4): each row tap with each column tap
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


class Qwen3VisionMLP(nn.Module):
    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        if args.hidden_act not in ACTIVATIONS:
            raise UserError(f"unknown vision hidden_act {args.hidden_act!r} ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[args.hidden_act]
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(args.hidden_size, eps=1e-6), nn.LayerNorm(args.hidden_size, eps=1e-6)
        self.attn = VisionAttention(args)
        self.mlp = Qwen3VisionMLP(args)

    def __call__(self, x: mx.array, angles: mx.array, segments) -> mx.array:
        h = x + self.attn(self.norm1(x), angles, segments)
        return h + self.mlp(self.norm2(h))


class Qwen3PatchMerger(nn.Module):
    """(N, D) -> (N / 4, out_hidden_size): the norm over each patch (the last merger) or
    over the four joined (DeepStack's), then fc1 / GELU / fc2."""

    def __init__(self, args: QwenVisionArgs, norm_after_joining: bool):
        super().__init__()
        self.merged = args.hidden_size * args.spatial_merge_size**2
        self.norm_after_joining = norm_after_joining
        self.norm = nn.LayerNorm(self.merged if norm_after_joining else args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, args.out_hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        # (N, D) -> (N / 4, 4 * D): each merge window's four patches side by side
        h = self.norm(x.reshape(-1, self.merged)) if self.norm_after_joining else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(nn.gelu(self.linear_fc1(h)))


class Qwen3VisionTower(nn.Module):
    """``visual.*`` of a Qwen3-VL checkpoint: pixel_values (N, C * T * P * P) and grid_thw
    (n, 3) -> (N / 4, (1 + n_deepstack) * out_hidden_size)."""

    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        self.args = args
        self.side = int(round(args.num_position_embeddings**0.5))
        if self.side * self.side != args.num_position_embeddings:
            raise UserError(f"num_position_embeddings {args.num_position_embeddings} is not a square grid")
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = [Qwen3VisionBlock(args) for _ in range(args.depth)]
        self.merger = Qwen3PatchMerger(args, norm_after_joining=False)
        self.deepstack_merger_list = [Qwen3PatchMerger(args, norm_after_joining=True)
                                      for _ in args.deepstack_visual_indexes]
        quarter = args.head_dim // 2  # h and w each turn half the rotated frequencies
        self._inv_freq = mx.array(1.0 / args.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))

    def __call__(self, pixel_values: mx.array, grid_thw) -> mx.array:
        grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        if (grid_thw[:, 1:] % self.args.spatial_merge_size).any():
            raise UserError(f"image grids {grid_thw.tolist()} are not multiples of the merge size "
                            f"{self.args.spatial_merge_size}")
        positions = patch_positions(grid_thw, self.args.spatial_merge_size)  # (N, 2)
        if pixel_values.shape[0] != positions.shape[0]:
            raise UserError(f"{pixel_values.shape[0]} patches for image grids of {positions.shape[0]}")
        h = self.patch_embed(pixel_values) + self.grid_positions(grid_thw)  # (N, D)
        # (N, 2, head_dim / 4) -> (N, head_dim / 2): the row's angles, then the column's
        angles = (mx.array(positions)[..., None] * self._inv_freq).reshape(h.shape[0], -1)
        images = segment_batch(image_segments(grid_thw))
        deepstack = []
        for i, block in enumerate(self.blocks):
            h = block(h, angles, images)
            if i in self.args.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.args.deepstack_visual_indexes.index(i)](h))
        return mx.concatenate([self.merger(h), *deepstack], axis=-1)

    def grid_positions(self, grid_thw: np.ndarray) -> mx.array:
        """The learned position table resampled to each image's grid: (N, D)."""
        indices, weights = interpolation_plan(grid_thw, self.args.spatial_merge_size, self.side)
        table = self.pos_embed(mx.array(indices))  # (N, 4, D); a quantized table reads the same way
        return (table * mx.array(weights)[..., None].astype(table.dtype)).sum(axis=1)


def make_qwen_tower(args: QwenVisionArgs) -> nn.Module:
    """The tower of ``args.style``: Qwen2-VL's and Qwen2.5-VL's, or Qwen3-VL's."""
    return Qwen3VisionTower(args) if args.style == "qwen3_vl" else QwenVisionTower(args)


def split_deepstack(features: mx.array, n_deepstack: int) -> tuple[mx.array, list[mx.array]]:
    """(n, (1 + n_deepstack) * D) -> the merged features (n, D) and each DeepStack's (n, D)."""
    parts = mx.split(features, 1 + n_deepstack, axis=-1)
    return parts[0], parts[1:]
