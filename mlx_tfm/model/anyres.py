"""LLaVA-NeXT's "anyres" images: the grid an image is cut into, and its views' features
packed back into one picture.

The processor resizes an image (aspect kept) into the best of ``image_grid_pinpoints``
(``select_best_resolution``), pads it, cuts it into ``rows x cols`` views of the tower's
input size and puts the whole image, squashed to that size, first. The model runs the tower
and projector over every view, then ``pack_anyres_features`` lays the grid views' features
out as one (rows * side) x (cols * side) picture, crops the padding back off
(``unpadded_grid``), appends the learned ``image_newline`` after every row and puts the
whole view's features first, as transformers' ``pack_image_features`` does.

The size math is plain Python so the processor (the prompt's token count) and the model
(the packing) share it. Shapes: V views of one image, T tokens per view (side x side), D
the language model's width.
"""

from __future__ import annotations

import math

import mlx.core as mx


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` that keeps the most of the image's pixels once
    it is fitted inside (aspect kept), the least padding on a tie (transformers' rule)."""
    best, most_kept, least_wasted = None, 0, math.inf
    for target_height, target_width in pinpoints:
        scale = min(target_width / width, target_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_width * target_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (target_height, target_width), kept, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The image's (height, width) resized inside ``target`` with its aspect kept (the
    side that is not filled rounded up, as transformers' ``get_patch_output_size``)."""
    target_height, target_width = target
    scale_width, scale_height = target_width / width, target_height / height
    if scale_width < scale_height:
        return min(math.ceil(height * scale_width), target_height), target_width
    return target_height, min(math.ceil(width * scale_height), target_width)


def anyres_grid(height: int, width: int, pinpoints, view_size: int) -> tuple[int, int]:
    """How many views (rows, cols) of ``view_size`` pixels an image is cut into."""
    best_height, best_width = select_best_resolution(height, width, pinpoints)
    return best_height // view_size, best_width // view_size


def unpadded_grid(height: int, width: int, grid_rows: int, grid_cols: int) -> tuple[int, int, int, int]:
    """The part of a (grid_rows, grid_cols) feature grid that is the image, not its padding:
    (first row, rows, first column, columns), with transformers' rounding (``unpad_image``)."""
    if width / height > grid_cols / grid_rows:  # padded above and below
        image_rows = int(round(height * (grid_cols / width), 7))
        padding = (grid_rows - image_rows) // 2
        return padding, grid_rows - 2 * padding, 0, grid_cols
    image_cols = int(round(width * (grid_rows / height), 7))
    padding = (grid_cols - image_cols) // 2
    return 0, grid_rows, padding, grid_cols - 2 * padding


def anyres_layout(height: int, width: int, pinpoints, view_size: int, side: int) -> tuple[int, int, int, int, int, int]:
    """An image's (grid rows, grid cols) of views and its unpadded feature grid (first row,
    rows, first column, columns), with ``side`` x ``side`` features per view."""
    rows, cols = anyres_grid(height, width, pinpoints, view_size)
    return (rows, cols, *unpadded_grid(height, width, rows * side, cols * side))


def pack_anyres_features(features: mx.array, image_sizes, pinpoints, view_size: int,
                         image_newline: mx.array) -> mx.array:
    """Every image's views' features (n_views, T, D), ``image_sizes`` (n_views, 2) the
    original (height, width) of the image each view belongs to -> (n_image_tokens, D):
    per image the whole view's T rows, then the unpadded grid row by row, each row ended
    by ``image_newline``."""
    sizes = [tuple(size) for size in mx.array(image_sizes).tolist()]
    n_views, T, D = features.shape
    side = math.isqrt(T)
    packed, start = [], 0
    while start < n_views:
        height, width = sizes[start]
        rows, cols, top, kept_rows, left, kept_cols = anyres_layout(height, width, pinpoints, view_size, side)
        end = start + 1 + rows * cols
        if end > n_views:
            raise ValueError(f"an image of {height}x{width} has {rows * cols + 1} views, {n_views - start} given")
        # (rows * cols, side * side, D) -> (rows, cols, side, side, D) -> (rows, side, cols, side, D)
        grid = features[start + 1:end].reshape(rows, cols, side, side, D).transpose(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * side, cols * side, D)[top:top + kept_rows, left:left + kept_cols]
        newline = mx.broadcast_to(image_newline.astype(grid.dtype), (kept_rows, 1, D))
        picture = mx.concatenate([grid, newline], axis=1).reshape(-1, D)  # (kept_rows * (kept_cols + 1), D)
        packed += [features[start], picture]
        start = end
    return mx.concatenate(packed) if packed else features.reshape(-1, D)
