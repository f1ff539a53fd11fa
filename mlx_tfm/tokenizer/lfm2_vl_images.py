"""LFM2-VL's images, as transformers' Lfm2VlImageProcessor (torchvision) computes them,
with PIL and numpy (no torch).

An image is resized (``smart_size``) so both sides are multiples of the encoder's patch
times the downsample factor, its image tokens between ``min_image_tokens`` and
``max_image_tokens``. An image too large for that (more than ``max_pixels_tolerance``
times the most pixels, at its own size rounded to those multiples) is instead, when
``do_image_splitting``, resized to a grid of ``tile_size`` tiles (the grid of
``min_tiles`` to ``max_tiles`` tiles nearest its aspect ratio) and cut into them, row by
row, followed by a thumbnail: the whole image at its smart size. Every resize is torch's
antialiased bilinear on the 8-bit image (fixed_point_resize.py). Each view is rescaled,
normalised, cut into patches (each flattened row by row, channels last) and padded with
zero patches to the most any view can hold; ``pixel_attention_mask`` marks the real ones
and ``spatial_shapes`` gives each view's patch grid.

In the prompt (image_tokens.py) each image is ``<|image_start|>``, then for a tiled image
each tile's ``<|img_row_r_col_c|>`` and its tokens and ``<|img_thumbnail|>`` and the
thumbnail's, else the one view's tokens, then ``<|image_end|>``; a view of h x w patches
takes ceil(h / f) * ceil(w / f) tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..errors import UserError
from .fixed_point_resize import resize_uint8
from .gemma4_images import cut_patches
from .images import HALF, ImageProcessing, load_image, normalized

LFM2_VL_PROCESSORS = ("Lfm2VlImageProcessor",)


@dataclass(frozen=True)
class Lfm2VlProcessing:
    """How LFM2-VL turns an image into views (``read_lfm2_vl_processing`` builds it)."""

    pixels: ImageProcessing  # rescale and normalisation
    encoder_patch_size: int = 16
    downsample_factor: int = 2
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    split: bool = True  # do_image_splitting
    min_tiles: int = 2
    max_tiles: int = 10
    use_thumbnail: bool = True
    tile_size: int = 512
    max_pixels_tolerance: float = 2.0
    kind: str = "lfm2_vl"

    @property
    def max_patches(self) -> int:
        """The patches every view is padded to: the most a thumbnail or a tile holds."""
        tile_patches = (self.tile_size // self.encoder_patch_size) ** 2 if self.split else 0
        return max(self.max_image_tokens * self.downsample_factor ** 2, tile_patches)

    def view_tokens(self, height: int, width: int) -> int:
        """Image tokens of a view of ``height x width`` pixels: its patch grid over f, rounded up."""
        p, f = self.encoder_patch_size, self.downsample_factor
        return math.ceil((height // p) / f) * math.ceil((width // p) / f)


def read_lfm2_vl_processing(settings: dict) -> Lfm2VlProcessing:
    """``preprocessor_config.json`` (a dict) -> ``Lfm2VlProcessing``; what transformers'
    processor does not do with torchvision's bilinear filter is a ``UserError``."""
    name = str(settings.get("image_processor_type", "Lfm2VlImageProcessor")).removesuffix("Fast")
    if name not in LFM2_VL_PROCESSORS:
        raise UserError(f"image processor {name!r} is not LFM2-VL's ({', '.join(LFM2_VL_PROCESSORS)})")
    if int(settings.get("resample", Image.BILINEAR)) != Image.BILINEAR:
        raise UserError("LFM2-VL's images resize with the bilinear filter only here (resample 2)")
    if settings.get("do_pad") is False:
        raise UserError("LFM2-VL's views are padded to one patch count here: set do_pad to true")
    pixels = ImageProcessing(
        kind="lfm2_vl", size=(0, 0), resample=Image.BILINEAR,
        rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
        mean=tuple(settings.get("image_mean") or HALF), std=tuple(settings.get("image_std") or HALF),
        do_rescale=bool(settings.get("do_rescale", True)), do_normalize=bool(settings.get("do_normalize", True)))
    names = ("encoder_patch_size", "downsample_factor", "min_image_tokens", "max_image_tokens", "min_tiles",
             "max_tiles", "use_thumbnail", "tile_size", "max_pixels_tolerance")
    fields = {name: settings[name] for name in names if settings.get(name) is not None}
    processing = Lfm2VlProcessing(pixels, split=bool(settings.get("do_image_splitting", True)), **fields)
    if processing.split and processing.min_tiles > processing.max_tiles:
        raise UserError(f"LFM2-VL's min_tiles ({processing.min_tiles}) is over its max_tiles ({processing.max_tiles})")
    return processing


# -- sizes -------------------------------------------------------------------------


def smart_size(height: int, width: int, processing: Lfm2VlProcessing) -> tuple[int, int]:
    """The (height, width) of an image's single view or thumbnail: each side the nearest
    multiple of patch x f, scaled (aspect kept as the rounding lets) into the token bounds."""
    factor = processing.encoder_patch_size * processing.downsample_factor
    pixels_per_token = processing.encoder_patch_size ** 2 * processing.downsample_factor ** 2
    min_pixels, max_pixels = processing.min_image_tokens * pixels_per_token, processing.max_image_tokens * pixels_per_token
    new_height, new_width = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        return (max(factor, math.floor(height / beta / factor) * factor),
                max(factor, math.floor(width / beta / factor) * factor))
    if new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return new_height, new_width


def is_too_large(height: int, width: int, processing: Lfm2VlProcessing) -> bool:
    """Whether the image, rounded to multiples of patch x f, holds more than the tolerance
    times the most pixels one view may."""
    factor = processing.encoder_patch_size * processing.downsample_factor
    rounded_height = max(processing.encoder_patch_size, round(height / factor) * factor)
    rounded_width = max(processing.encoder_patch_size, round(width / factor) * factor)
    most = processing.max_image_tokens * processing.encoder_patch_size ** 2 * processing.downsample_factor ** 2
    return rounded_height * rounded_width > most * processing.max_pixels_tolerance


def tile_grid(height: int, width: int, processing: Lfm2VlProcessing) -> tuple[int, int]:
    """(rows, cols) of tiles: the grid of min_tiles..max_tiles tiles whose aspect ratio is
    nearest the image's; of two equally near, the later (larger) one when the image has
    more than half its pixels. Candidates in transformers' order (by tile count)."""
    low, high = processing.min_tiles, processing.max_tiles
    candidates = sorted({(w, h) for n in range(low, high + 1) for w in range(1, n + 1) for h in range(1, n + 1)
                         if low <= w * h <= high}, key=lambda ratio: ratio[0] * ratio[1])
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for cols, rows in candidates:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and height * width > 0.5 * processing.tile_size ** 2 * cols * rows:
            best = (cols, rows)
    return best[1], best[0]


# -- views -------------------------------------------------------------------------


def image_views(pixels: np.ndarray, processing: Lfm2VlProcessing) -> tuple[list[np.ndarray], int, int, int]:
    """One (H, W, 3) uint8 image -> (its views, uint8; tile rows; tile cols; the tokens of
    its whole-image view: the single view, or the thumbnail (0 without one))."""
    height, width = pixels.shape[:2]
    whole_size = smart_size(height, width, processing)
    whole_tokens = processing.view_tokens(*whole_size)
    if not (processing.split and is_too_large(height, width, processing)):
        return [resize_uint8(pixels, *whole_size)], 1, 1, whole_tokens
    rows, cols = tile_grid(height, width, processing)
    tile = processing.tile_size
    grid = resize_uint8(pixels, rows * tile, cols * tile)
    # (rows * tile, cols * tile, 3) -> (rows, cols, tile, tile, 3): tiles row by row
    tiles = list(grid.reshape(rows, tile, cols, tile, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, tile, tile, 3))
    if processing.use_thumbnail and rows * cols != 1:
        return [*tiles, resize_uint8(pixels, *whole_size)], rows, cols, whole_tokens
    return tiles, rows, cols, 0


def patches_of(view: np.ndarray, processing: Lfm2VlProcessing) -> np.ndarray:
    """A (H, W, 3) uint8 view -> its (H / p * W / p, p * p * 3) float32 patches."""
    return cut_patches(normalized(view, processing.pixels), processing.encoder_patch_size)


def preprocess_lfm2_vl_images(images: list, processing: Lfm2VlProcessing) -> dict:
    """Images -> ``pixel_values`` float32 (n_views, max_patches, p * p * 3) of every view
    of every image in order, ``pixel_attention_mask`` int32 (n_views, max_patches),
    ``spatial_shapes`` int64 (n_views, 2); per image ``views``, the tile grid (``rows``,
    ``cols``: 1, 1 untiled) and ``whole_tokens`` (its whole-image view's tokens)."""
    views, per_image = [], {"views": [], "rows": [], "cols": [], "whole_tokens": []}
    for source in images:
        image_view_list, rows, cols, whole_tokens = image_views(np.asarray(load_image(source)), processing)
        views += image_view_list
        for name, value in zip(per_image, (len(image_view_list), rows, cols, whole_tokens)):
            per_image[name].append(value)
    p = processing.encoder_patch_size
    pixel_values = np.zeros((len(views), processing.max_patches, 3 * p * p), np.float32)
    mask = np.zeros((len(views), processing.max_patches), np.int32)
    for i, view in enumerate(views):
        cut = patches_of(view, processing)
        if len(cut) > processing.max_patches:  # an extreme aspect ratio: the side bounds cannot hold its tokens
            raise UserError(f"an image resized to {view.shape[1]}x{view.shape[0]} has {len(cut)} patches, more than "
                            f"LFM2-VL's {processing.max_patches} a view: its aspect ratio is too extreme")
        pixel_values[i, :len(cut)] = cut
        mask[i, :len(cut)] = 1
    shapes = np.array([(view.shape[0] // p, view.shape[1] // p) for view in views], np.int64).reshape(-1, 2)
    return {"pixel_values": pixel_values, "pixel_attention_mask": mask, "spatial_shapes": shapes, **per_image}


def lfm2_vl_image_text(image_token: str, tokens_per_tile: int, rows: int, cols: int, whole_tokens: int,
                       begin: str = "", end: str = "") -> str:
    """One image's tokens: ``begin``; for a tiled image each tile's row/column marker and
    tokens, then the thumbnail's marker and tokens (``whole_tokens``, 0 without one); for
    one view its tokens; ``end``. Without ``begin`` (no image special tokens) only the image
    tokens are written."""
    marked = bool(begin)
    if rows == 1 and cols == 1:
        return begin + image_token * whole_tokens + end
    tiles = "".join((f"<|img_row_{r + 1}_col_{c + 1}|>" if marked else "") + image_token * tokens_per_tile
                    for r in range(rows) for c in range(cols))
    thumbnail = ("<|img_thumbnail|>" if marked else "") + image_token * whole_tokens if whole_tokens else ""
    return begin + tiles + thumbnail + end
