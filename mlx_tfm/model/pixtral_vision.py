"""Pixtral's vision tower and Mistral 3's projector: images of any size, 2D RoPE.

Each image (C, H, W) is cut into p x p patches (the patch convolution as one matmul, no
bias), RMS-normed (``ln_pre``), and run through pre-norm blocks (RMSNorm, attention
without biases, a gated MLP) on its own: Pixtral packs the images into one sequence with a
block-diagonal mask, which is the same as running each image alone. There is no position
table: each patch's queries and keys are rotated by its (row, column), the first quarter
of a head's frequencies by the row and the second by the column (axial RoPE, halves
rotated as in Llama).

Mistral 3's projector (``Mistral3Projector``): RMSNorm, the patch merger (each s x s block
of the patch grid side by side, one linear map back to the tower's width), then LLaVA's
linear_1 -> activation -> linear_2 into the language model's width. Pixtral 12B (a
``llava`` checkpoint with this tower) has that MLP alone (``LlavaMLPProjector``).

``PixtralVisionLanguageModel`` is ``VisionLanguageModel`` with this tower and projector;
``encode_images(pixel_values (N, C, H_max, W_max), image_sizes (N, 2))`` reads each image's
top-left ``image_sizes[i]`` pixels (the processor pads to the largest).

Shapes: N images, P patches of one image, D the tower's width, hd a head's width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .layers import ACTIVATIONS, RMSNorm
from .transformer import Model
from .vision_args import VisionArgs
from .vision_language import VisionLanguageModel
from .vision_tower import unfold_patches


@dataclass(frozen=True)
class PixtralArgs:
    """The tower's and the projector's fields (``VisionArgs.tower_fields`` holds them)."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24  # the layers run (the feature layer's output is the last)
    num_attention_heads: int = 16
    head_dim: int = 64
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    patch_size: int = 16
    num_channels: int = 3
    norm_eps: float = 1e-5  # Pixtral's norms: fixed in its code, not configured
    # the projector: "mistral3" (RMSNorm, patch merger, MLP) | "llava" (the MLP alone: Pixtral 12B)
    projector: str = "mistral3"
    spatial_merge_size: int = 2
    projector_norm_eps: float = 1e-5  # the text model's rms_norm_eps
    projector_act: str = "gelu"
    projector_bias: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "PixtralArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in names and v is not None})


def axial_rope_angles(rows: int, cols: int, head_dim: int, theta: float) -> mx.array:
    """(rows * cols, hd / 2) angles, patches row-major: the first hd / 4 frequencies turn
    with the row, the next hd / 4 with the column (the even- and odd-indexed ones of the
    1D table over hd)."""
    inv_freq = 1.0 / (theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))  # (hd / 2,)
    row_angles = mx.arange(rows, dtype=mx.float32)[:, None] * inv_freq[0::2]  # (rows, hd / 4)
    col_angles = mx.arange(cols, dtype=mx.float32)[:, None] * inv_freq[1::2]  # (cols, hd / 4)
    row_part = mx.broadcast_to(row_angles[:, None, :], (rows, cols, head_dim // 4))
    col_part = mx.broadcast_to(col_angles[None, :, :], (rows, cols, head_dim // 4))
    return mx.concatenate([row_part, col_part], axis=-1).reshape(rows * cols, head_dim // 2)


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Llama's half rotation: x (..., P, hd) with cos, sin (P, hd)."""
    half = x.shape[-1] // 2
    rotated_half = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated_half * sin


class PixtralAttention(nn.Module):
    def __init__(self, args: PixtralArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        inner = args.num_attention_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, args.hidden_size, bias=False)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        B, P, _ = x.shape

        def heads(t: mx.array) -> mx.array:  # (B, P, n_heads * hd) -> (B, n_heads, P, hd)
            return t.reshape(B, P, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)

        queries = rotate(heads(self.q_proj(x)), cos, sin)
        keys = rotate(heads(self.k_proj(x)), cos, sin)
        out = mx.fast.scaled_dot_product_attention(queries, keys, heads(self.v_proj(x)), scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, P, -1))  # (B, P, n_heads * hd)


class PixtralMLP(nn.Module):
    def __init__(self, args: PixtralArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.act = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, args: PixtralArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attention = PixtralAttention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.feed_forward = PixtralMLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class PixtralTransformer(nn.Module):
    def __init__(self, args: PixtralArgs):
        super().__init__()
        self.layers = [PixtralLayer(args) for _ in range(args.num_hidden_layers)]

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class PatchConvolution(nn.Module):
    """The patch convolution (stride = kernel = p, no bias) as a matmul; ``weight`` keeps
    the checkpoint's (D, C, p, p)."""

    def __init__(self, args: PixtralArgs):
        super().__init__()
        p = args.patch_size
        self.patch_size = p
        self.weight = mx.zeros((args.hidden_size, args.num_channels, p, p))

    def __call__(self, pixels: mx.array) -> mx.array:
        """(1, C, H, W) -> (1, P, D)."""
        patches = unfold_patches(pixels.astype(self.weight.dtype), self.patch_size)
        return patches @ self.weight.reshape(self.weight.shape[0], -1).T  # (D, C*p*p) transposed


class PixtralVisionTower(nn.Module):
    """``tower(image (1, C, H, W))`` -> (rows * cols, D): the last run layer's states."""

    def __init__(self, args: PixtralArgs):
        super().__init__()
        self.args = args
        self.patch_conv = PatchConvolution(args)
        self.ln_pre = RMSNorm(args.hidden_size, args.norm_eps)
        self.transformer = PixtralTransformer(args)

    def __call__(self, image: mx.array) -> mx.array:
        p = self.args.patch_size
        rows, cols = image.shape[-2] // p, image.shape[-1] // p
        angles = axial_rope_angles(rows, cols, self.args.head_dim, self.args.rope_theta)
        angles = mx.concatenate([angles, angles], axis=-1)  # (P, hd): both halves turn alike
        h = self.ln_pre(self.patch_conv(image[..., :rows * p, :cols * p]))
        cos, sin = mx.cos(angles).astype(h.dtype), mx.sin(angles).astype(h.dtype)
        return self.transformer(h, cos, sin)[0]


def merge_patches(states: mx.array, rows: int, cols: int, scale: int) -> mx.array:
    """One image's (rows * cols, D) -> (rows / s * cols / s, D * s * s): each s x s block,
    row-major, as one vector ordered (D, s, s) as torch's ``unfold`` orders it; a grid
    side that is not a multiple of s loses its last rows or columns, as there."""
    D = states.shape[-1]
    out_rows, out_cols = rows // scale, cols // scale
    grid = states.reshape(rows, cols, D)[:out_rows * scale, :out_cols * scale]
    # (out_rows, s, out_cols, s, D) -> (out_rows, out_cols, D, s, s)
    blocks = grid.reshape(out_rows, scale, out_cols, scale, D).transpose(0, 2, 4, 1, 3)
    return blocks.reshape(out_rows * out_cols, D * scale * scale)


class PatchMerger(nn.Module):
    def __init__(self, args: PixtralArgs):
        super().__init__()
        self.scale = args.spatial_merge_size
        self.merging_layer = nn.Linear(args.hidden_size * self.scale ** 2, args.hidden_size, bias=False)

    def __call__(self, states: mx.array, rows: int, cols: int) -> mx.array:
        return self.merging_layer(merge_patches(states, rows, cols, self.scale))


class Mistral3Projector(nn.Module):
    """``projector(states (P, D), rows, cols)`` -> (T, D_text), T = (rows / s) * (cols / s)."""

    def __init__(self, args: PixtralArgs, text_hidden_size: int):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.projector_norm_eps)
        self.patch_merger = PatchMerger(args)
        self.linear_1 = nn.Linear(args.hidden_size, text_hidden_size, bias=args.projector_bias)
        self.act = ACTIVATIONS[args.projector_act]
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=args.projector_bias)

    def __call__(self, states: mx.array, rows: int, cols: int) -> mx.array:
        merged = self.patch_merger(self.norm(states), rows, cols)
        return self.linear_2(self.act(self.linear_1(merged)))


class LlavaMLPProjector(nn.Module):
    """``projector(states (P, D), rows, cols)`` -> (P, D_text): one image token per patch."""

    def __init__(self, args: PixtralArgs, text_hidden_size: int):
        super().__init__()
        self.linear_1 = nn.Linear(args.hidden_size, text_hidden_size, bias=args.projector_bias)
        self.act = ACTIVATIONS[args.projector_act]
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=args.projector_bias)

    def __call__(self, states: mx.array, rows: int, cols: int) -> mx.array:
        return self.linear_2(self.act(self.linear_1(states)))


PIXTRAL_PROJECTORS = {"mistral3": Mistral3Projector, "llava": LlavaMLPProjector}


class PixtralVisionLanguageModel(VisionLanguageModel):
    """Mistral 3 and Pixtral 12B: ``language_model``, ``vision_tower`` (Pixtral),
    ``multi_modal_projector`` (``PixtralArgs.projector``)."""

    def __init__(self, args: ModelArgs):
        # VisionLanguageModel.__init__ builds the ViT tower; this model builds its own
        nn.Module.__init__(self)
        self.args = args
        self.vision_args = VisionArgs.from_dict(args.vision)
        self.pixtral = PixtralArgs.from_dict(self.vision_args.tower_fields)
        self.language_model = Model(dataclasses.replace(args, vision=None))
        self.vision_tower = PixtralVisionTower(self.pixtral)
        if self.pixtral.projector not in PIXTRAL_PROJECTORS:
            raise ValueError(f"unknown Pixtral projector {self.pixtral.projector!r} ({', '.join(PIXTRAL_PROJECTORS)})")
        self.multi_modal_projector = PIXTRAL_PROJECTORS[self.pixtral.projector](self.pixtral, args.hidden_size)

    def encode_images(self, pixel_values: mx.array, image_sizes=None) -> mx.array:
        """Pixel values (N, C, H, W), image i in its top-left ``image_sizes[i]`` (height,
        width; all of it when None) -> features (n_image_tokens, D), image by image, each
        row-major over its merged patch grid."""
        N, _, H, W = pixel_values.shape
        sizes = [(H, W)] * N if image_sizes is None else mx.array(image_sizes).tolist()
        if len(sizes) != N:
            raise ValueError(f"{len(sizes)} image sizes for {N} images")
        p, features = self.pixtral.patch_size, []
        for image, (height, width) in zip(pixel_values, sizes):
            states = self.vision_tower(image[None, :, :height, :width])  # (P, D)
            features.append(self.multi_modal_projector(states, height // p, width // p))
        return mx.concatenate(features) if features else mx.zeros((0, self.args.hidden_size))
