"""Qwen2-VL's and Qwen2.5-VL's vision tower: patches -> encoder blocks -> 2x2 merger.

The tower reads ``pixel_values`` (N, C * T * P * P), the patches of every image one after
another in merge-window order (``tokenizer/qwen_images.py``), with ``grid_thw`` (n, 3).
Each patch is embedded by one matmul (the checkpoint's Conv3d has kernel = stride, so it
sees each patch once), rotated by its (row, column) in a 2D rotary over the head's
halves, and attends only within its own image (Qwen2-VL), or within its window of
``window_size`` pixels except in the ``fullatt_block_indexes`` blocks (Qwen2.5-VL, whose
windows are made contiguous by reordering the merged patches and put back at the end).
The merger normalises each patch, concatenates each 2x2 window's four and maps them to
the language model's width: (N, D) -> (N / 4, out_hidden_size).

Blocks: Qwen2-VL LayerNorm + fc1 / QuickGELU / fc2; Qwen2.5-VL RMSNorm + SwiGLU (biased).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserError
from .attention import attention
from .config import ModelArgs
from .layers import MLP, RMSNorm
from .mrope import rotate_by_angles

STYLES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class QwenVisionArgs:
    """The tower's configuration, read from a checkpoint's ``vision_config``."""

    style: str = "qwen2_5_vl"
    depth: int = 32
    hidden_size: int = 1280  # the tower's own width
    num_heads: int = 16
    intermediate_size: int = 3420
    out_hidden_size: int = 3584  # the language model's width
    hidden_act: str = "silu"
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 0  # pixels; 0: every block attends over the whole image
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Qwen3-VL (model/qwen3_vision.py): a learned square grid of positions resampled to each
    # image, and the blocks whose states also reach the language model's first layers
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, config: dict, style: str) -> "QwenVisionArgs":
        """Qwen2-VL names the width ``embed_dim`` and the output ``hidden_size`` (with an
        ``mlp_ratio``); Qwen2.5-VL names them ``hidden_size`` and ``out_hidden_size``."""
        if style not in STYLES:
            raise UserError(f"unknown Qwen vision tower {style!r} ({', '.join(STYLES)})")
        rope = config.get("rope_parameters") or {}
        common = {
            "style": style, "depth": config.get("depth"), "num_heads": config.get("num_heads"),
            "patch_size": config.get("patch_size"), "temporal_patch_size": config.get("temporal_patch_size"),
            "in_channels": config.get("in_channels") or config.get("in_chans"),
            "spatial_merge_size": config.get("spatial_merge_size"), "rope_theta": rope.get("rope_theta"),
        }
        if style == "qwen2_vl":
            width = config.get("embed_dim", cls.hidden_size)
            own = {"hidden_size": width, "out_hidden_size": config.get("hidden_size"),
                   "intermediate_size": int(width * config.get("mlp_ratio", 4)),
                   "hidden_act": config.get("hidden_act") or "quick_gelu"}
        else:
            own = {"hidden_size": config.get("hidden_size"), "out_hidden_size": config.get("out_hidden_size"),
                   "intermediate_size": config.get("intermediate_size"),
                   "hidden_act": config.get("hidden_act") or ("gelu_pytorch_tanh" if style == "qwen3_vl" else None),
                   "window_size": config.get("window_size"),
                   "fullatt_block_indexes": tuple(config.get("fullatt_block_indexes") or ()),
                   "num_position_embeddings": config.get("num_position_embeddings"),
                   "deepstack_visual_indexes": tuple(config.get("deepstack_visual_indexes") or ())}
        return cls(**{k: v for k, v in {**common, **own}.items() if v is not None})

    @classmethod
    def from_fields(cls, fields: dict) -> "QwenVisionArgs":
        """Back from ``dataclasses.asdict`` (as ``VisionArgs.qwen_tower`` holds it)."""
        return cls(**{**fields, "fullatt_block_indexes": tuple(fields.get("fullatt_block_indexes") or ()),
                      "deepstack_visual_indexes": tuple(fields.get("deepstack_visual_indexes") or ())})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# -- where each patch goes: computed from the grids, in numpy -----------------------


@dataclass(frozen=True)
class PatchLayout:
    """The per-patch plan of one call: rotary (row, column) positions (N, 2), the order
    of the merged patches that makes windows contiguous (None: no windows), and the
    attention segment of each patch (N,) for full and windowed blocks, in that order."""

    positions: np.ndarray
    window_order: np.ndarray | None
    image_segments: np.ndarray
    window_segments: np.ndarray | None


def patch_positions(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """(row, column) of every patch (N, 2), in the merge-window order pixel_values has."""
    positions = []
    for t, h, w in grid_thw.tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        # (h, w) -> (h / m, m, w / m, m) -> windows row by row, patches inside each
        rows, cols = (a.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols))
        positions.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))  # (t * h * w, 2)
    return np.concatenate(positions)


def image_segments(grid_thw: np.ndarray) -> np.ndarray:
    """Which frame of which image each patch belongs to (N,): full attention stays inside it."""
    return np.repeat(np.arange(int(grid_thw[:, 0].sum())), np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]))


def window_plan(grid_thw: np.ndarray, merge_size: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's windows of ``window`` x ``window`` merged patches: the order (M,) that
    lists the merged patches window by window (row-major inside each), and the window
    number of each merged patch in that order (M,). Edge windows are smaller."""
    order, windows, first_unit, first_window = [], [], 0, 0
    for t, h, w in grid_thw.tolist():
        frame, rows, cols = np.meshgrid(np.arange(t), np.arange(h // merge_size), np.arange(w // merge_size),
                                        indexing="ij")
        across, down = -(-(w // merge_size) // window), -(-(h // merge_size) // window)
        window_of = (frame * down + rows // window) * across + cols // window  # (t, rows, cols)
        flat = window_of.reshape(-1)
        ranked = np.lexsort((np.arange(flat.size), flat))  # by window, then row-major inside it
        order.append(ranked + first_unit)
        _, numbered = np.unique(flat[ranked], return_inverse=True)
        windows.append(numbered + first_window)
        first_unit += flat.size
        first_window += int(numbered.max()) + 1
    return np.concatenate(order), np.concatenate(windows)


def patch_layout(grid_thw, args: QwenVisionArgs) -> PatchLayout:
    """The plan of one call to the tower for images of ``grid_thw`` (n, 3)."""
    grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    merge = args.spatial_merge_size
    if (grid_thw[:, 1:] % merge).any():
        raise UserError(f"image grids {grid_thw.tolist()} are not multiples of the merge size {merge}")
    positions, segments = patch_positions(grid_thw, merge), image_segments(grid_thw)
    if not args.window_size:
        return PatchLayout(positions, None, segments, None)
    order, windows = window_plan(grid_thw, merge, args.window_size // merge // args.patch_size)
    unit = merge * merge
    # each merged patch's unit patches follow it: (M,) -> (N,)
    patch_order = (order[:, None] * unit + np.arange(unit)).reshape(-1)
    return PatchLayout(positions[patch_order], order, segments[patch_order], np.repeat(windows, unit))


@dataclass(frozen=True)
class SegmentBatch:
    """Contiguous attention segments (images, or windows) laid out as a padded batch, so
    each attends within itself in one batched call and no (N, N) mask is built:
    ``gather`` (S, W) patch indices, ``key_mask`` (S, 1, 1, W) True at real patches (None
    when every segment is W long), ``scatter`` (N,) the real rows of the (S * W) output."""

    gather: mx.array
    key_mask: mx.array | None
    scatter: mx.array


def segment_batch(segments: np.ndarray) -> SegmentBatch:
    """The padded batch of a segment number per patch (N,), each segment one run."""
    starts = np.flatnonzero(np.diff(segments, prepend=-1))
    lengths = np.diff(np.append(starts, len(segments)))
    slots = np.arange(lengths.max())
    real = slots[None, :] < lengths[:, None]  # (S, W)
    gather = np.where(real, starts[:, None] + slots, 0)  # padding reads patch 0, masked out
    key_mask = None if real.all() else mx.array(real[:, None, None, :])
    return SegmentBatch(mx.array(gather), key_mask, mx.array(np.flatnonzero(real.reshape(-1))))


# -- the modules -------------------------------------------------------------------------


def quick_gelu(x: mx.array) -> mx.array:
    """x * sigmoid(1.702 x): CLIP's and Qwen2-VL's tower activation."""
    return x * mx.sigmoid(1.702 * x)


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (T, P, P) as a matmul: (N, C * T * P * P) -> (N, D);
    Qwen3-VL's has a bias."""

    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        patch = args.in_channels * args.temporal_patch_size * args.patch_size**2
        self.proj = nn.Linear(patch, args.hidden_size, bias=args.style == "qwen3_vl")

    def __call__(self, pixel_values: mx.array) -> mx.array:
        return self.proj(pixel_values)


class VisionAttention(nn.Module):
    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.num_heads, args.head_dim
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def __call__(self, x: mx.array, angles: mx.array, segments: SegmentBatch) -> mx.array:
        """x (N, D), angles (N, head_dim / 2) -> (N, D), attending within each segment."""
        N, D = x.shape
        # (N, 3 * D) -> (N, 3, n_heads, head_dim) -> (3, N, n_heads, head_dim)
        qkv = self.qkv(x).reshape(N, 3, self.n_heads, self.head_dim).transpose(1, 0, 2, 3)
        queries, keys = rotate_by_angles(qkv[0], angles[:, None]), rotate_by_angles(qkv[1], angles[:, None])
        # (N, n_heads, head_dim) -> (S, W, n_heads, head_dim) -> (S, n_heads, W, head_dim)
        queries, keys, values = (t[segments.gather].transpose(0, 2, 1, 3) for t in (queries, keys, qkv[2]))
        out = attention(queries, keys, values, self.head_dim**-0.5, segments.key_mask)
        out = out.transpose(0, 2, 1, 3).reshape(-1, D)  # (S, n_heads, W, head_dim) -> (S * W, D)
        return self.proj(out[segments.scatter])  # the real patches, in their order: (N, D)


class VisionMLP(nn.Module):
    """Qwen2-VL's ungated MLP: fc2(quick_gelu(fc1(x)))."""

    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        if args.hidden_act != "quick_gelu":
            raise UserError(f"Qwen2-VL's vision MLP takes quick_gelu, not {args.hidden_act!r}")
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(quick_gelu(self.fc1(x)))


def gated_mlp(args: QwenVisionArgs) -> MLP:
    """Qwen2.5-VL's SwiGLU with biases: the language model's MLP at the tower's width."""
    mlp_args = ModelArgs.from_dict({"hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
                                    "hidden_act": args.hidden_act, "ffn_gated": True, "mlp_bias": True,
                                    "num_attention_heads": args.num_heads})
    return MLP(mlp_args)


def tower_norm(args: QwenVisionArgs, dims: int) -> nn.Module:
    if args.style == "qwen2_vl":
        return nn.LayerNorm(dims, eps=args.norm_eps)
    return RMSNorm(dims, args.norm_eps)


class VisionBlock(nn.Module):
    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        self.norm1, self.norm2 = tower_norm(args, args.hidden_size), tower_norm(args, args.hidden_size)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args) if args.style == "qwen2_vl" else gated_mlp(args)

    def __call__(self, x: mx.array, angles: mx.array, segments: SegmentBatch) -> mx.array:
        h = x + self.attn(self.norm1(x), angles, segments)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """Each 2x2 window's four normed patches side by side -> MLP -> the text width."""

    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        self.merged = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = tower_norm(args, args.hidden_size)
        # named mlp.0 and mlp.2 as in checkpoints (index 1 is the GELU, without weights)
        self.mlp = [nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, args.out_hidden_size)]

    def __call__(self, x: mx.array) -> mx.array:
        h = self.ln_q(x).reshape(-1, self.merged)  # (N, D) -> (N / 4, 4 * D)
        for layer in self.mlp:
            h = layer(h)
        return h


class QwenVisionTower(nn.Module):
    """``visual.*`` in checkpoints: pixel_values (N, C * T * P * P) and grid_thw (n, 3)
    -> image features (N / merge_size**2, out_hidden_size), images one after another."""

    def __init__(self, args: QwenVisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = [VisionBlock(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)
        quarter = args.head_dim // 2  # h and w each turn half the rotated frequencies
        self._inv_freq = mx.array(1.0 / args.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))

    def __call__(self, pixel_values: mx.array, grid_thw) -> mx.array:
        layout = patch_layout(grid_thw, self.args)
        if pixel_values.shape[0] != layout.positions.shape[0]:
            raise UserError(f"{pixel_values.shape[0]} patches for image grids of {layout.positions.shape[0]}")
        h = self.patch_embed(pixel_values)  # (N, D)
        if layout.window_order is not None:
            h = self._reordered(h, layout.window_order)
        # (N, 2, head_dim / 4) -> (N, head_dim / 2): the row's angles, then the column's
        angles = (mx.array(layout.positions)[..., None] * self._inv_freq).reshape(h.shape[0], -1)
        images = segment_batch(layout.image_segments)
        windows = images if layout.window_segments is None else segment_batch(layout.window_segments)
        for i, block in enumerate(self.blocks):
            full = layout.window_segments is None or i in self.args.fullatt_block_indexes
            h = block(h, angles, images if full else windows)
        merged = self.merger(h)  # (N / 4, out_hidden_size)
        if layout.window_order is not None:
            merged = merged[mx.array(np.argsort(layout.window_order))]
        return merged

    def _reordered(self, h: mx.array, order: np.ndarray) -> mx.array:
        """Patches (N, D) with their merged groups in ``order``: (N / 4, 4, D)[order] -> (N, D)."""
        unit = self.args.spatial_merge_size**2
        return h.reshape(-1, unit, h.shape[-1])[mx.array(order)].reshape(h.shape)
