"""LFM2-VL's image side: SigLIP2's NaFlex tower (images at their own aspect ratio) and the
pixel-unshuffle projector, beside the LFM2 language model.

The processor hands the tower patches already cut (channels last inside each patch):
``pixel_values`` (N, max_patches, p * p * C), image i's first h_i * w_i rows real and
``spatial_shapes`` (N, 2) their grids. Each patch goes through one linear map; the
learned position table (a G x G grid) is resized to the image's h x w grid by a separable
triangle filter (bilinear, antialiased when shrinking: torch's ``interpolate`` with
``antialias=True``, which SigLIP2 uses) and added. From there it is the seeds' encoder
(``TransformerModel`` of kind "encoder", SigLIP's blocks and post-norm) over that image's
patches alone; SigLIP2 pads the images to one length and masks the padding, which is the
same.

The projector (``Lfm2VlProjector``): each f x f block of the patch grid side by side (row
offset, column offset, channel), LayerNorm, linear_1 -> activation -> linear_2; a grid
side that is not a multiple of f loses its last rows or columns.

Shapes: N images, P patches of one image, G the position grid's side, D the tower's width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .layers import ACTIVATIONS
from .transformer import Model, TransformerModel
from .vision_args import VisionArgs
from .vision_language import VisionLanguageModel


@dataclass(frozen=True)
class NaFlexArgs:
    """The patch embedding's and the projector's fields (``VisionArgs.tower_fields``)."""

    num_patches: int = 256  # the position table: a sqrt(num_patches) square grid
    patch_size: int = 16
    num_channels: int = 3
    downsample_factor: int = 2
    projector_hidden_size: int = 2560
    projector_act: str = "gelu"
    projector_bias: bool = True
    projector_layernorm: bool = True

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "NaFlexArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in names and v is not None})


def resize_weights(out_size: int, grid: int) -> mx.array:
    """(out_size, grid): each output position's weights over the grid, a triangle filter
    as wide as the scale when shrinking (antialias), plain linear interpolation when
    growing; sample centres at half-pixel offsets (align_corners false)."""
    scale = grid / out_size
    support = max(scale, 1.0)
    centres = (mx.arange(out_size, dtype=mx.float32) + 0.5) * scale - 0.5
    distance = mx.abs(mx.arange(grid, dtype=mx.float32)[None, :] - centres[:, None])
    weights = mx.maximum(1 - distance / support, 0.0)
    return weights / weights.sum(axis=-1, keepdims=True)


def resized_positions(table: mx.array, rows: int, cols: int) -> mx.array:
    """A (G * G, D) position table, row-major over its grid -> (rows * cols, D)."""
    G = math.isqrt(table.shape[0])
    row_weights, col_weights = resize_weights(rows, G), resize_weights(cols, G)
    weights = row_weights[:, None, :, None] * col_weights[None, :, None, :]  # (rows, cols, G, G)
    return weights.reshape(rows * cols, G * G) @ table.astype(mx.float32)  # (rows * cols, D)


class NaFlexEmbeddings(nn.Module):
    """``patch_embedding`` (a linear map over a cut patch) and the ``position_embedding`` table."""

    def __init__(self, tower: ModelArgs, naflex: NaFlexArgs):
        super().__init__()
        patch_dims = naflex.num_channels * naflex.patch_size ** 2
        self.patch_embedding = nn.Linear(patch_dims, tower.hidden_size)
        self.position_embedding = nn.Embedding(naflex.num_patches, tower.hidden_size)

    def __call__(self, patches: mx.array, rows: int, cols: int) -> mx.array:
        """One image's (P, p * p * C) patches, P = rows * cols -> (1, P, D)."""
        h = self.patch_embedding(patches.astype(self.patch_embedding.weight.dtype))
        return (h + resized_positions(self.position_embedding.weight, rows, cols).astype(h.dtype))[None]


class NaFlexTower(nn.Module):
    """``tower(patches (P, p * p * C), rows, cols)`` -> (P, D), SigLIP2's last hidden state."""

    def __init__(self, tower: ModelArgs, naflex: NaFlexArgs):
        super().__init__()
        if tower.kind != "encoder" or tower.own_embeddings or tower.position_embedding != "none":
            raise ValueError("a NaFlex tower is kind 'encoder' without token or position embeddings of its own")
        self.embeddings = NaFlexEmbeddings(tower, naflex)
        self.encoder = TransformerModel(tower)

    def __call__(self, patches: mx.array, rows: int, cols: int) -> mx.array:
        return self.encoder(self.embeddings(patches, rows, cols))[0]


def unshuffle_patches(states: mx.array, rows: int, cols: int, factor: int) -> mx.array:
    """One image's (rows * cols, D) -> (rows / f * cols / f, f * f * D): each f x f block,
    row-major, as one vector ordered (row offset, column offset, D)."""
    D = states.shape[-1]
    out_rows, out_cols = rows // factor, cols // factor
    grid = states.reshape(rows, cols, D)[:out_rows * factor, :out_cols * factor]
    # (out_rows, f, out_cols, f, D) -> (out_rows, out_cols, f, f, D)
    blocks = grid.reshape(out_rows, factor, out_cols, factor, D).transpose(0, 2, 1, 3, 4)
    return blocks.reshape(out_rows * out_cols, factor * factor * D)


class Lfm2VlProjector(nn.Module):
    """``projector(states (P, D), rows, cols)`` -> (T, D_text), T = (rows / f) * (cols / f)."""

    def __init__(self, tower: ModelArgs, naflex: NaFlexArgs, text_hidden_size: int):
        super().__init__()
        self.factor = naflex.downsample_factor
        in_dims = tower.hidden_size * self.factor ** 2
        if naflex.projector_layernorm:
            self.layer_norm = nn.LayerNorm(in_dims, eps=1e-5)
        self.linear_1 = nn.Linear(in_dims, naflex.projector_hidden_size, bias=naflex.projector_bias)
        self.act = ACTIVATIONS[naflex.projector_act]
        self.linear_2 = nn.Linear(naflex.projector_hidden_size, text_hidden_size, bias=naflex.projector_bias)

    def __call__(self, states: mx.array, rows: int, cols: int) -> mx.array:
        h = unshuffle_patches(states, rows, cols, self.factor)
        if "layer_norm" in self:
            h = self.layer_norm(h)
        return self.linear_2(self.act(self.linear_1(h)))


class Lfm2VlModel(VisionLanguageModel):
    """LFM2-VL: ``language_model`` (LFM2), ``vision_tower`` (NaFlex), ``multi_modal_projector``."""

    def __init__(self, args: ModelArgs):
        # VisionLanguageModel.__init__ builds the fixed-size ViT; this model builds its own
        nn.Module.__init__(self)
        self.args = args
        self.vision_args = VisionArgs.from_dict(args.vision)
        self.naflex = NaFlexArgs.from_dict(self.vision_args.tower_fields)
        tower = self.vision_args.tower_args()
        self.language_model = Model(dataclasses.replace(args, vision=None))
        self.vision_tower = NaFlexTower(tower, self.naflex)
        self.multi_modal_projector = Lfm2VlProjector(tower, self.naflex, args.hidden_size)

    def encode_images(self, pixel_values: mx.array, spatial_shapes=None, pixel_attention_mask=None) -> mx.array:
        """Cut patches (N, max_patches, p * p * C) and each image's patch grid (N, 2) ->
        features (n_image_tokens, D), image by image, row-major over its merged grid. The
        mask is implied by the grids (an image's first rows * cols patches are real)."""
        if spatial_shapes is None:
            raise ValueError("LFM2-VL's tower needs each image's patch grid (spatial_shapes)")
        features = []
        for patches, (rows, cols) in zip(pixel_values, mx.array(spatial_shapes).tolist()):
            states = self.vision_tower(patches[:rows * cols], rows, cols)  # (P, D)
            features.append(self.multi_modal_projector(states, rows, cols))
        return mx.concatenate(features) if features else mx.zeros((0, self.args.hidden_size))
