"""Pixtral's images (Mistral 3): any size, as transformers' slow PixtralImageProcessor
(PIL + numpy, no torch).

An image larger than ``longest_edge`` on a side is scaled down (both sides divided by the
larger ratio, floored); then each side is rounded up to a multiple of the tower's patch
times the patch merge (what PixtralProcessor hands its image processor), resized (bicubic,
on the 8-bit image), rescaled and normalised with CLIP's constants. The images are padded
with zeros at the bottom and right to the largest of them, and ``image_sizes`` says where
each one lies.

In the prompt each image is its grid of merged patches, row by row: ``[IMG]`` per token,
``[IMG_BREAK]`` after each row, the last one ``[IMG_END]`` (``pixtral_image_text``).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from ..errors import UserError
from .images import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageProcessing,
    load_image,
    normalized,
    resized,
)

PIXTRAL_PROCESSORS = ("PixtralImageProcessor",)


def read_pixtral_processing(settings: dict, config: dict) -> ImageProcessing:
    """``preprocessor_config.json`` (``settings``) and config.json -> ``ImageProcessing``
    of kind "pixtral": ``size`` the longest edge, ``tile`` the multiple each side is rounded
    up to (the tower's patch x ``spatial_merge_size``, from config.json)."""
    name = str(settings.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    if name not in PIXTRAL_PROCESSORS:
        raise UserError(f"image processor {name or '(none)'!r} is not Pixtral's ({', '.join(PIXTRAL_PROCESSORS)})")
    size = settings.get("size") or {"longest_edge": 1024}
    if "longest_edge" not in size:
        raise UserError("a Pixtral image processor without size.longest_edge is not supported")
    vision = config.get("vision_config") or {}
    # Mistral 3 merges 2 x 2 patches unless it says otherwise; Pixtral 12B (llava) merges none
    merge = config.get("spatial_merge_size", 2 if config.get("model_type") == "mistral3" else 1)
    multiple = vision.get("patch_size", 14) * merge
    return ImageProcessing(
        kind="pixtral", size=(size["longest_edge"],) * 2, tile=multiple,
        resample=int(settings.get("resample", Image.BICUBIC)),
        rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
        mean=tuple(settings.get("image_mean") or OPENAI_CLIP_MEAN), std=tuple(settings.get("image_std") or OPENAI_CLIP_STD),
        do_resize=bool(settings.get("do_resize", True)), do_rescale=bool(settings.get("do_rescale", True)),
        do_normalize=bool(settings.get("do_normalize", True)))


def pixtral_size(height: int, width: int, longest_edge: int, multiple: int) -> tuple[int, int]:
    """The resized (height, width): at most ``longest_edge`` (aspect kept, floored), then each
    side up to a multiple of ``multiple``."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return ((height - 1) // multiple + 1) * multiple, ((width - 1) // multiple + 1) * multiple


def preprocess_pixtral_images(images: list, processing: ImageProcessing) -> dict:
    """Images -> ``pixel_values`` float32 (n_images, 3, H_max, W_max), zero-padded;
    ``image_sizes`` (n_images, 2) each image's (height, width); ``rows`` and ``cols`` its
    grid of image tokens (merged patches); ``views`` one per image."""
    frames = []
    for source in images:
        image = load_image(source)
        if processing.do_resize:
            height, width = pixtral_size(image.height, image.width, processing.size[0], processing.tile)
            image = resized(image, height, width, processing.resample)
        frames.append(normalized(image, processing))
    sizes = np.array([f.shape[1:] for f in frames], np.int64).reshape(-1, 2)
    H, W = (sizes.max(axis=0) if len(frames) else (1, 1))
    pixel_values = np.zeros((len(frames), 3, H, W), np.float32)
    for i, frame in enumerate(frames):
        pixel_values[i, :, :frame.shape[1], :frame.shape[2]] = frame
    rows, cols = (sizes // processing.tile).T.tolist() if len(frames) else ([], [])
    return {"pixel_values": pixel_values, "image_sizes": sizes, "rows": rows, "cols": cols, "views": [1] * len(frames)}


def pixtral_image_text(image_token: str, rows: int, cols: int, break_token: str = "[IMG_BREAK]",
                       end_token: str = "[IMG_END]") -> str:
    """One image's tokens: ``rows`` lines of ``cols`` image tokens, each ended by the break
    token but the last, which the end token ends."""
    line = image_token * cols
    return (line + break_token) * (rows - 1) + line + end_token
