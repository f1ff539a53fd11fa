"""Rotary positions given per token: Qwen2-VL's M-RoPE (3D positions t, h, w) in the
language model and the vision tower's 2D (h, w) rotary.

M-RoPE splits a head's ``head_dim / 2`` rotation frequencies into ``mrope_section``
(t, h, w) runs: frequency i turns by ``position[section of i] * theta_i``. A text token
has t = h = w, which makes it the ordinary RoPE; an image's merged patches share one t and
take their row and column as h and w. After an image the text continues at the largest
position used so far plus one, so the sequence's positions end ``rope_delta`` away from
its length, and decoding after the prompt turns at ``offset + rope_delta``.

Shapes: positions (3, B, L); angles (B, L, head_dim / 2); heads (B, n_heads, L, head_dim).
"""

from __future__ import annotations

from itertools import groupby

import mlx.core as mx
import numpy as np

from ..errors import UserError
from .positions import RoPE, rope_type


def rotate_by_angles(x: mx.array, angles: mx.array) -> mx.array:
    """x (..., L, head_dim) rotated pairwise (i, i + head_dim / 2), Hugging Face's
    rotate_half layout, by ``angles`` (..., L, head_dim / 2) that broadcast against x."""
    cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
    first, second = mx.split(x, 2, axis=-1)
    return mx.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def frequency_axes(sections: tuple[int, ...], interleaved: bool = False, n_frequencies: int | None = None
                   ) -> np.ndarray:
    """Which axis (0 t, 1 h, 2 w) turns each of the ``n_frequencies`` (default
    sum(sections)): the sections one run after another (Qwen2-VL), or interleaved t, h, w,
    t, h, w, ... with t taking what is left at the end (Qwen3-VL: frequency 3k + 1 is h's
    while k < h's section, 3k + 2 w's). Interleaved sections are read as transformers
    slices them, so sections that overrun the frequencies are cut where they end: a config
    that keeps Qwen3.5's published (11, 11, 10) on a narrower rotary loads as it runs there."""
    if not interleaved:
        return np.repeat(np.arange(len(sections)), sections)
    axes = np.zeros(sum(sections) if n_frequencies is None else n_frequencies, dtype=np.int64)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes


def section_angles(positions: mx.array, inv_freq: mx.array, sections: tuple[int, ...],
                   interleaved: bool = False) -> mx.array:
    """positions (3, B, L) -> angles (B, L, head_dim / 2): frequency i turns by the
    position of the axis whose section holds it (``frequency_axes``)."""
    axis_of_frequency = frequency_axes(sections, interleaved, inv_freq.shape[0])  # (head_dim / 2,)
    if len(axis_of_frequency) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {list(sections)} sums to {len(axis_of_frequency)}, "
                         f"not head_dim / 2 = {inv_freq.shape[0]}")
    chosen = positions[mx.array(axis_of_frequency)]  # (head_dim / 2, B, L): each frequency's axis
    return chosen.transpose(1, 2, 0).astype(mx.float32) * inv_freq  # (B, L, head_dim / 2)


class MRoPE(RoPE):
    """RoPE that also takes explicit positions: ``__call__(x, where)`` with ``where`` an
    offset (every axis at the same position: the ordinary rotary, on its fused routes) or
    the (3, B, L) positions of M-RoPE."""

    def __init__(self, dims: int, base: float, sections: tuple[int, ...], max_positions: int,
                 interleaved: bool = False):
        super().__init__(dims, False, base, None, max_positions)
        self.sections = tuple(sections)
        self.interleaved = interleaved
        self._inv_freq = mx.array((1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)).astype(np.float32))
        section_angles(mx.zeros((3, 1, 1), mx.int32), self._inv_freq, self.sections, interleaved)  # checks the sections

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if not (isinstance(offset, mx.array) and offset.ndim == 3):  # an int, or per-row offsets (B,)
            return super().__call__(x, offset)
        angles = section_angles(offset, self._inv_freq, self.sections, self.interleaved)  # (B, L, dims / 2)
        if self.dims == x.shape[-1]:
            return rotate_by_angles(x, angles[:, None])  # broadcast over heads
        # a partial rotary (Qwen3.5): the first dims of each head turn, the rest pass
        return mx.concatenate([rotate_by_angles(x[..., : self.dims], angles[:, None]), x[..., self.dims :]], axis=-1)


def make_mrope(args, head_dim: int) -> MRoPE | None:
    """The M-RoPE of a model whose ``rope_scaling`` is ``{"rope_type": "mrope",
    "mrope_section": [t, h, w]}`` (as Qwen2-VL's checkpoints first wrote it; Qwen3-VL's add
    ``"mrope_interleaved": true``); else None."""
    if rope_type(args.rope_scaling) != "mrope":
        return None
    dims = int(head_dim * args.partial_rotary_factor)
    return MRoPE(dims, args.rope_theta, args.rope_scaling["mrope_section"], args.max_position_embeddings,
                 bool(args.rope_scaling.get("mrope_interleaved")))


class ExplicitPositions:
    """A layer's cache with the (3, B, L) M-RoPE positions of this call's tokens: how
    ``TransformerModel`` hands them to each attention layer through the one
    ``mixer(x, mask, cache)`` signature. ``cache`` may be None (a forward without one)."""

    def __init__(self, cache, positions: mx.array):
        self.cache = cache
        self.positions = positions


def multimodal_positions(token_ids: list[int], image_token_id: int, image_grid_thw, merge_size: int
                         ) -> tuple[np.ndarray, int]:
    """M-RoPE positions (3, L) of one prompt and its ``rope_delta`` (the last position + 1
    minus L). Each run of ``image_token_id`` is the next image of ``image_grid_thw``: its
    merged patches at (start, start + row, start + column); text counts on from there."""
    grids = iter(np.asarray(image_grid_thw).reshape(-1, 3).tolist())
    pieces, start = [], 0
    for is_image, run in groupby(token_ids, key=lambda token: token == image_token_id):
        length = len(list(run))
        if not is_image:
            pieces.append(np.broadcast_to(np.arange(start, start + length), (3, length)))
            start += length
            continue
        grid_t, rows, cols = _merged_grid(next(grids, None), merge_size, length)
        t, h, w = np.meshgrid(np.arange(grid_t), np.arange(rows), np.arange(cols), indexing="ij")
        pieces.append(np.stack([t, h, w]).reshape(3, -1) + start)  # (3, grid_t * rows * cols)
        start += max(rows, cols)
    if next(grids, None) is not None:
        raise UserError("there are more images than image-token runs in the prompt")
    positions = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)
    return positions, int(positions.max(initial=-1)) + 1 - len(token_ids)


def _merged_grid(grid, merge_size: int, n_tokens: int) -> tuple[int, int, int]:
    """(t, rows, columns) of an image's merged patches, checked against its token run."""
    if grid is None:
        raise UserError("the prompt has more image-token runs than images")
    grid_t, rows, cols = grid[0], grid[1] // merge_size, grid[2] // merge_size
    if grid_t * rows * cols != n_tokens:
        raise UserError(f"an image of {grid_t * rows * cols} merged patches has {n_tokens} image tokens in the prompt")
    return grid_t, rows, cols


def batch_positions(prompts: list[list[int]], image_token_id: int, image_grid_thw, merge_size: int
                    ) -> tuple[mx.array, list[int]]:
    """Positions (3, B, L) of equal-length prompts whose images come in order in
    ``image_grid_thw``, and each row's rope_delta."""
    counts = [_image_runs(ids, image_token_id) for ids in prompts]
    grids = np.asarray(image_grid_thw).reshape(-1, 3)
    starts = np.cumsum([0, *counts])
    rows = [multimodal_positions(ids, image_token_id, grids[a:b], merge_size)
            for ids, a, b in zip(prompts, starts[:-1], starts[1:])]
    return mx.array(np.stack([p for p, _ in rows], axis=1)), [delta for _, delta in rows]


def _image_runs(token_ids: list[int], image_token_id: int) -> int:
    return sum(1 for is_image, _ in groupby(token_ids, key=lambda token: token == image_token_id) if is_image)


def decode_positions(offset: int, rope_deltas: list[int], length: int = 1) -> mx.array:
    """Positions (3, B, L) of ``length`` text tokens after ``offset`` cached ones: every
    axis at offset + rope_delta onwards (the prompt's images pushed the positions on)."""
    rows = mx.array(rope_deltas)[:, None] + mx.arange(offset, offset + length)  # (B, L)
    return mx.broadcast_to(rows[None], (3, *rows.shape))


def sequence_positions(prompt_positions: mx.array | None, rope_delta: int, offset: int, length: int) -> mx.array:
    """Positions (3, 1, length) of one sequence's tokens from ``offset`` on: the prompt's
    own (``prompt_positions`` (3, 1, n), from ``multimodal_positions``; None: a text
    prompt, every axis at the token's index), then past the prompt text positions
    ``rope_delta`` behind the count (``decode_positions``)."""
    n_prompt = 0 if prompt_positions is None else prompt_positions.shape[2]
    end = min(offset + length, n_prompt)
    pieces = [prompt_positions[:, :, offset:end]] if offset < end else []
    if offset + length > end:
        pieces.append(decode_positions(max(offset, end), [rope_delta], offset + length - max(offset, end)))
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)  # (3, 1, length)
