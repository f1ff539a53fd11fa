"""Qwen2-VL / Qwen2.5-VL image preprocessing with PIL and numpy (no torch).

An image is resized so both sides are multiples of ``patch_size * merge_size`` (28) with
its area between ``min_pixels`` and ``max_pixels`` (``smart_resize``), rescaled to [0, 1],
normalised by the CLIP mean and std, repeated ``temporal_patch_size`` times (a still image
is a two-frame clip to the tower's 3D patch embedding) and cut into patches flattened in
the order the tower reads them: merge windows (2x2 patches) one after another, each patch
as (C, T, P, P). ``image_grid_thw`` says (t, h, w) in patches for each image.

The prompt's one ``<|image_pad|>`` per image becomes ``t * h * w / merge_size**2`` of them:
one per merged patch the tower hands the language model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..errors import UserError

# CLIP's channel statistics, which Qwen's processors normalise by.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class QwenImageSettings:
    """What ``preprocessor_config.json`` sets for Qwen's image processor."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, config: dict) -> "QwenImageSettings":
        """From a ``preprocessor_config.json``: ``size`` {shortest_edge, longest_edge} (the
        pixel bounds) or the older ``min_pixels`` / ``max_pixels`` keys."""
        size = config.get("size") or {}
        values = {
            "patch_size": config.get("patch_size"),
            "temporal_patch_size": config.get("temporal_patch_size"),
            "merge_size": config.get("merge_size"),
            "min_pixels": config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels"),
            "max_pixels": config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels"),
            "image_mean": tuple(config["image_mean"]) if config.get("image_mean") else None,
            "image_std": tuple(config["image_std"]) if config.get("image_std") else None,
            "rescale_factor": config.get("rescale_factor"),
        }
        return cls(**{k: v for k, v in values.items() if v is not None})

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this: one merge window, in pixels."""
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor``, scaled (keeping the aspect ratio
    as near as the rounding lets) into [min_pixels, max_pixels] of area."""
    if min(height, width) < 1:
        raise UserError(f"an image of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise UserError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is over {MAX_ASPECT_RATIO}")
    rounded_h, rounded_w = round(height / factor) * factor, round(width / factor) * factor
    if rounded_h * rounded_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        return (max(factor, math.floor(height / shrink / factor) * factor),
                max(factor, math.floor(width / shrink / factor) * factor))
    if rounded_h * rounded_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        return math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return rounded_h, rounded_w


def normalized_pixels(image: Image.Image, settings: QwenImageSettings) -> np.ndarray:
    """The image resized (bicubic, on its 8-bit RGB pixels), rescaled and normalised:
    (C, H, W) float32 with H and W multiples of ``settings.factor``."""
    rgb = image.convert("RGB")
    height, width = smart_resize(rgb.height, rgb.width, settings.factor, settings.min_pixels, settings.max_pixels)
    resized = np.asarray(rgb.resize((width, height), resample=Image.Resampling.BICUBIC))  # (H, W, C) uint8
    scaled = (resized.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    mean = np.asarray(settings.image_mean, dtype=np.float32)
    std = np.asarray(settings.image_std, dtype=np.float32)
    return ((scaled - mean) / std).transpose(2, 0, 1)  # (H, W, C) -> (C, H, W)


def flatten_patches(pixels: np.ndarray, settings: QwenImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(C, H, W) -> patches (grid_h * grid_w, C * T * P * P) in merge-window order, and
    the grid (1, grid_h, grid_w): a still image is one temporal patch of T equal frames."""
    C, H, W = pixels.shape
    P, M, T = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    grid_h, grid_w = H // P, W // P
    # (C, H, W) -> (C, grid_h / M, M, P, grid_w / M, M, P)
    patches = pixels.reshape(C, grid_h // M, M, P, grid_w // M, M, P)
    # -> (grid_h / M, grid_w / M, M, M, C, P, P): windows row by row, patches inside each
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)
    # -> (..., C, T, P, P): each patch repeated as T frames
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], T, P, P))
    return patches.reshape(grid_h * grid_w, C * T * P * P), (1, grid_h, grid_w)


def preprocess_images(images: list[Image.Image], settings: QwenImageSettings | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``pixel_values`` (total patches, C * T * P * P) float32 of every image one after
    another, and ``image_grid_thw`` (n_images, 3) int64."""
    settings = settings or QwenImageSettings()
    if not images:
        raise UserError("no images to preprocess")
    flat, grids = zip(*(flatten_patches(normalized_pixels(image, settings), settings) for image in images))
    return np.concatenate(flat, axis=0), np.asarray(grids, dtype=np.int64)


def image_token_counts(image_grid_thw: np.ndarray, merge_size: int) -> list[int]:
    """How many ``<|image_pad|>`` tokens each image takes: one per merged patch."""
    return [int(np.prod(grid)) // merge_size**2 for grid in image_grid_thw]


def expand_image_tokens(text: str, image_grid_thw: np.ndarray, merge_size: int,
                        image_token: str = "<|image_pad|>") -> str:
    """``text`` (a rendered chat template) with its i-th ``image_token`` repeated as many
    times as image i has merged patches."""
    pieces = text.split(image_token)
    counts = image_token_counts(image_grid_thw, merge_size)
    if len(pieces) - 1 != len(counts):
        raise UserError(f"the prompt has {len(pieces) - 1} image placeholders for {len(counts)} images")
    expanded = [pieces[0]]
    for count, piece in zip(counts, pieces[1:]):
        expanded += [image_token * count, piece]
    return "".join(expanded)
