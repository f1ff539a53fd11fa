"""LLaVA-NeXT's "anyres" preprocessing without torch, as transformers' slow
``LlavaNextImageProcessor`` (PIL) does it.

Per image: the best of ``image_grid_pinpoints`` for its size (model/anyres.py), the image
resized into it with its aspect kept (bicubic on the 8-bit image), padded with black to fill
it (centred, the odd pixel after), cut row by row into views of the crop size; first of all
the whole image resized (squashed) to ``size``. Every view then goes through CLIP's
shortest-edge resize and centre crop (no-ops at that size), rescaling and normalising.

``preprocess_llava_next_images`` returns what ``preprocess_images`` does, plus
``image_sizes`` (n_views, 2): each view's image's original (height, width), which the model
packs the views by. Its ``rows`` and ``cols`` are each image's unpadded feature grid (the
prompt's tokens: the whole view's, then ``rows`` rows of ``cols`` features and a newline).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from ..model.anyres import anyres_layout, fitted_size, select_best_resolution
from .images import ImageProcessing, clip_view, load_image, normalized, resized


def padded_into(image: Image.Image, target: tuple[int, int]) -> Image.Image:
    """``image`` centred on a black ``target`` (height, width), the odd pixel after it."""
    height, width = target
    canvas = Image.new("RGB", (width, height))
    canvas.paste(image, ((width - image.width) // 2, (height - image.height) // 2))
    return canvas


def anyres_views(image: Image.Image, processing: ImageProcessing) -> list[Image.Image]:
    """The whole image at ``size``, then the views of its padded best resolution, row by row."""
    best = select_best_resolution(image.height, image.width, processing.grid_pinpoints)
    fitted = resized(image, *fitted_size(image.height, image.width, best), processing.resample)
    padded, edge = padded_into(fitted, best), processing.tile
    views = [padded.crop((left, top, left + edge, top + edge))
             for top in range(0, best[0], edge) for left in range(0, best[1], edge)]
    return [resized(image, *processing.size, processing.resample), *views]


def preprocess_llava_next_images(images: list, processing: ImageProcessing) -> dict:
    """Images (paths, bytes or PIL images) -> ``pixel_values`` float32 (n_views, 3, H, W),
    ``image_sizes`` (n_views, 2), ``views`` per image, ``rows`` and ``cols`` (each image's
    unpadded feature grid)."""
    frames, sizes, views, rows, cols = [], [], [], [], []
    patch = processing.patch_size
    for source in images:
        image = load_image(source)
        image_views = anyres_views(image, processing)
        frames += [normalized(clip_view(view, processing), processing) for view in image_views]
        sizes += [(image.height, image.width)] * len(image_views)
        views.append(len(image_views))
        *_, kept_rows, _, kept_cols = anyres_layout(image.height, image.width, processing.grid_pinpoints,
                                                    processing.tile, processing.tile // patch)
        rows.append(kept_rows)
        cols.append(kept_cols)
    pixel_values = np.stack(frames) if frames else np.zeros((0, 3, 1, 1), np.float32)
    return {"pixel_values": pixel_values, "image_sizes": np.array(sizes, np.int64).reshape(-1, 2), "views": views,
            "rows": rows, "cols": cols}
