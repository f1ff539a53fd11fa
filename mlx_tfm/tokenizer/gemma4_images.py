"""Gemma 4's images, as transformers' slow Gemma4ImageProcessor (PIL + numpy, no torch).

Each image is resized (bicubic, on the 8-bit image) to the largest size that keeps its
aspect ratio, holds at most ``max_soft_tokens * k * k`` patches of ``patch_size`` and has
both sides multiples of k patches (k = ``pooling_kernel_size``: each k x k block of
patches becomes one soft token); rescaled to [0, 1] (no normalisation by default); cut into
patches, each flattened row by row with its channels last; and padded to that many patches.
``image_position_ids`` holds each patch's (x, y), -1 for the padding.

In the prompt each image is ``<begin>`` + one image token per soft token + ``<end>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..errors import UserError
from .images import ImageProcessing, load_image, normalized, resized

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # what transformers accepts for max_soft_tokens


@dataclass(frozen=True)
class Gemma4Processing:
    """How Gemma 4 turns an image into patches (``read_gemma4_processing`` builds it)."""

    pixels: ImageProcessing  # rescale and normalisation
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    kind: str = "gemma4"


def read_gemma4_processing(settings: dict) -> Gemma4Processing:
    """``preprocessor_config.json`` (a dict) -> ``Gemma4Processing``."""
    budget = settings.get("max_soft_tokens", 280)
    if budget not in SOFT_TOKEN_BUDGETS:
        raise UserError(f"Gemma 4's max_soft_tokens is one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}, not {budget}")
    pixels = ImageProcessing(
        kind="gemma4", size=(0, 0), resample=int(settings.get("resample", Image.BICUBIC)),
        rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
        mean=tuple(settings.get("image_mean") or (0.0, 0.0, 0.0)), std=tuple(settings.get("image_std") or (1.0, 1.0, 1.0)),
        do_resize=bool(settings.get("do_resize", True)), do_rescale=bool(settings.get("do_rescale", True)),
        do_normalize=bool(settings.get("do_normalize", False)))
    return Gemma4Processing(pixels, settings.get("patch_size", 16), budget, settings.get("pooling_kernel_size", 3))


def gemma4_size(height: int, width: int, processing: Gemma4Processing) -> tuple[int, int]:
    """The resized (height, width): the patch budget's area at the image's aspect ratio,
    each side floored to a multiple of k patches; a side that floors to nothing gets one
    block and the other the (floored) aspect ratio in blocks, at most the budget's run."""
    k, p = processing.pooling_kernel_size, processing.patch_size
    target_pixels = processing.max_soft_tokens * k * k * p * p
    factor = math.sqrt(target_pixels / (height * width))
    block = k * p
    new_height, new_width = int(math.floor(factor * height / block)) * block, int(math.floor(factor * width / block)) * block
    if new_height == 0 and new_width == 0:
        raise UserError(f"a {width}x{height} image is too narrow for Gemma 4's {block}-pixel blocks")
    longest = processing.max_soft_tokens * block
    if new_height == 0:
        new_height, new_width = block, min(int(math.floor(width / height)) * block, longest)
    elif new_width == 0:
        new_height, new_width = min(int(math.floor(height / width)) * block, longest), block
    return new_height, new_width


def cut_patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """(C, H, W) -> (H / p * W / p, p * p * C): patches row by row, each (p, p, C) flattened."""
    C, H, W = pixels.shape
    # (C, rows, p, cols, p) -> (rows, cols, p, p, C)
    grid = pixels.reshape(C, H // patch, patch, W // patch, patch).transpose(1, 3, 2, 4, 0)
    return grid.reshape((H // patch) * (W // patch), patch * patch * C)


def preprocess_gemma4_images(images: list, processing: Gemma4Processing) -> dict:
    """Images -> ``pixel_values`` float32 (n_images, max_patches, p * p * 3),
    ``image_position_ids`` int64 (n_images, max_patches, 2) and each image's soft-token
    grid (``rows``, ``cols``: its patch grid over k)."""
    k, p = processing.pooling_kernel_size, processing.patch_size
    max_patches = processing.max_soft_tokens * k * k
    pixel_values = np.zeros((len(images), max_patches, p * p * 3), np.float32)
    positions = -np.ones((len(images), max_patches, 2), np.int64)
    rows, cols = [], []
    for i, source in enumerate(images):
        image = load_image(source)
        if processing.pixels.do_resize:
            image = resized(image, *gemma4_size(image.height, image.width, processing), processing.pixels.resample)
        patches = cut_patches(normalized(image, processing.pixels), p)
        grid_rows, grid_cols = image.height // p, image.width // p
        ys, xs = np.meshgrid(np.arange(grid_rows), np.arange(grid_cols), indexing="ij")
        pixel_values[i, :len(patches)] = patches
        positions[i, :len(patches)] = np.stack([xs.ravel(), ys.ravel()], axis=-1)
        rows.append(grid_rows // k)
        cols.append(grid_cols // k)
    return {"pixel_values": pixel_values, "image_position_ids": positions, "rows": rows, "cols": cols,
            "views": [1] * len(images)}
