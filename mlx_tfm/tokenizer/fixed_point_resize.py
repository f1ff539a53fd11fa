"""torch's antialiased bilinear resize of an 8-bit image, in numpy: what torchvision's
``resize`` (``interpolate(mode="bilinear", antialias=True)`` on uint8) computes on a CPU
with AVX2, to the last bit.

The filter is separable and PIL's: for each output sample a triangle filter as wide as the
scale when shrinking (one input sample each side when growing), its taps normalised to sum
to one. For 8-bit input torch computes in fixed point (aten's UpSampleKernel.cpp,
``_compute_index_ranges_int16_weights``): each axis's float64 weights are scaled by
``2 ** precision`` (the largest precision at which the axis's largest weight still fits in
an int16) and rounded; each output is ``(2 ** (precision - 1) + sum(w * pixel)) >>
precision``, clipped to 0..255. The width is resized first, its result kept in 8 bits,
then the height; an axis whose size does not change is not touched.

(torchvision without AVX2, and on a GPU, resizes the uint8 image as float32 and rounds at
the end instead, which differs by one level at some pixels.)
"""

from __future__ import annotations

import math

import numpy as np

MAX_PRECISION = 22  # torch's bound on the weights' fixed-point bits


def triangle_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(first tap (out_size,), float64 weights (out_size, taps)) of one axis, as torch's
    ``_compute_indices_min_size_weights_aa`` (align_corners false, the scale in / out)."""
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0
    taps = math.ceil(support) * 2 + 1
    inverse = 1.0 / scale if scale >= 1.0 else 1.0
    firsts, weights = np.zeros(out_size, np.int64), np.zeros((out_size, taps), np.float64)
    for i in range(out_size):
        centre = scale * (i + 0.5)
        first = max(int(centre - support + 0.5), 0)  # int() truncates toward zero, as the C++ cast
        count = min(max(min(int(centre + support + 0.5), in_size) - first, 0), taps)
        row = [max(0.0, 1.0 - abs((j + first - centre + 0.5) * inverse)) for j in range(count)]
        total = sum(row)  # summed in order, as torch does
        firsts[i] = first
        weights[i, :count] = [w / total for w in row] if total != 0.0 else row
    return firsts, weights


def fixed_point_weights(weights: np.ndarray) -> tuple[np.ndarray, int]:
    """float64 weights -> (int weights, precision): the most bits at which the largest
    weight, rounded, stays under 2 ** 15; each weight rounded half away from zero."""
    largest = float(weights.max())
    precision = 0
    while precision < MAX_PRECISION and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64), precision


def resize_axis(pixels: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """uint8 ``pixels`` resized along ``axis`` (0 or 1 of (H, W, C)) to ``out_size``. The
    sums fit int32 (as torch's do): the weights of one output sum to 2 ** precision <= 2 ** 22."""
    in_size = pixels.shape[axis]
    if in_size == out_size:
        return pixels
    firsts, weights = triangle_weights(in_size, out_size)
    integer, precision = fixed_point_weights(weights)
    shape = [1, 1, 1]
    shape[axis] = out_size  # each output's weight broadcast along the other axes
    total = np.full(pixels.shape[:axis] + (out_size,) + pixels.shape[axis + 1:], 1 << (precision - 1), np.int32)
    for tap in range(integer.shape[1]):  # past an output's own taps the weight is 0: any index in range will do
        sources = np.take(pixels, np.minimum(firsts + tap, in_size - 1), axis=axis).astype(np.int32)
        total += integer[:, tap].astype(np.int32).reshape(shape) * sources
    return np.clip(total >> precision, 0, 255).astype(np.uint8)


def resize_uint8(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, C) uint8 -> (height, width, C) uint8: torch's antialiased bilinear resize,
    the width first."""
    return resize_axis(resize_axis(pixels, width, axis=1), height, axis=0)
