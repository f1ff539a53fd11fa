"""A request's images, ready for the engine: ``read_images(processor, sources)`` runs the
family's preprocessing once (``VisionProcessor.preprocess``, through tokenizer/images.py's
loader, which refuses what is not an image, a truncated file and a decompression bomb) and
returns ``ImageInputs``: the pixel values of every view (Qwen's: every image's patches) and the
tower's other inputs (LFM2-VL's patch grids, Qwen's ``grid_thw``), how many image tokens each
image takes, the tile grid the prompt writes, and a content digest per image.

The digests key the shared prefix cache: image tokens all have one id, so two different
pictures after the same text would look alike to a cache that compares ids. ``cache_keys``
gives each image token a key made of the digests of its own image and every image before
it (negative, so it never equals a real token id): the same images in the same places
reuse the cache, a different image never does.

The tower runs later, on the engine's thread (``encode``), and only for a row whose prompt
still has image tokens to read after the prefix it reused.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import UserError
from ..tokenizer.image_tokens import expand_image_placeholders, image_token_count
from ..tokenizer.qwen_images import image_token_counts as qwen_tokens_per_image
from ..tokenizer.qwen_processor import QwenVisionProcessor


@dataclass(frozen=True)
class ImageInputs:
    """The preprocessed images of one prompt, in the order the prompt places them."""

    pixel_values: np.ndarray  # float32, every view of every image: (n_views, C, H, W), or cut patches
    tokens_per_image: tuple[int, ...]  # image tokens each image takes in the prompt
    rows: tuple[int, ...]  # Idefics3's and LFM2-VL's tile grid per image (else 0)
    cols: tuple[int, ...]
    digests: tuple[str, ...]  # sha256 of each image's pixel values (and tower inputs)
    whole_tokens: tuple[int, ...] = ()  # LFM2-VL: the tokens of each image's whole-image view
    # encode_images' other inputs: LFM2-VL's a row per view, Qwen's grid_thw a row per image
    tower_inputs: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens_per_image)

    def expand(self, processor, text: str) -> str:
        """``text`` with each image placeholder written out as its image's tokens (no
        placeholder at all: the images go first), as ``VisionProcessor.prepare`` does."""
        if isinstance(processor, QwenVisionProcessor):  # its runs follow each image's grid
            return processor.expand_images(text, self.tower_inputs["grid_thw"])
        if len(self) and processor.placeholder not in text:
            text = processor.placeholder * len(self) + text
        return expand_image_placeholders(text, processor.image_prompt, list(self.rows), list(self.cols),
                                         list(self.whole_tokens) or None)

    def cache_keys(self, prompt: list[int], image_token_id: int) -> list[int]:
        """``prompt`` with each image token replaced by its image's key (see the module
        docstring); a prompt whose image tokens are not the images' count is a ``UserError``."""
        owners = [i for i, n in enumerate(self.tokens_per_image) for _ in range(n)]  # image of each image token
        positions = [p for p, token in enumerate(prompt) if token == image_token_id]
        if len(positions) != len(owners):
            raise UserError(f"the prompt has {len(positions)} image tokens for {len(owners)} from its images")
        keys, running = list(prompt), hashlib.sha256()
        image_keys = []
        for digest in self.digests:
            running.update(digest.encode())
            image_keys.append(-1 - int.from_bytes(running.digest()[:8], "big") // 2)
        for position, owner in zip(positions, owners):
            keys[position] = image_keys[owner]
        return keys

    def encode(self, model) -> mx.array:
        """The images' features (n_image_tokens, D), one row per image token in order."""
        features = model.encode_images(mx.array(self.pixel_values), **self.tower_inputs)
        mx.eval(features)
        return features


def read_images(processor, sources: list) -> ImageInputs:
    """Images (paths, encoded bytes or PIL images) -> ``ImageInputs`` for ``processor`` (a
    ``VisionProcessor`` or ``QwenVisionProcessor``); anything that is not a readable image is
    a one-line ``UserError``."""
    if isinstance(processor, QwenVisionProcessor):
        return read_qwen_images(processor, sources)
    inputs = processor.preprocess(sources)
    tower_inputs = {name: inputs[name] for name in processor.tower_input_names}
    whole_tokens = inputs.get("whole_tokens") or [0] * len(inputs["views"])
    tokens = tuple(image_token_count(processor.image_prompt, *grid)
                   for grid in zip(inputs["rows"], inputs["cols"], whole_tokens))
    starts = np.cumsum([0, *inputs["views"]])
    digests = tuple(view_digest([inputs["pixel_values"][a:b], *(value[a:b] for value in tower_inputs.values())])
                    for a, b in itertools.pairwise(starts))
    return ImageInputs(pixel_values=inputs["pixel_values"], tokens_per_image=tokens, rows=tuple(inputs["rows"]),
                       cols=tuple(inputs["cols"]), digests=digests, whole_tokens=tuple(inputs.get("whole_tokens", ())),
                       tower_inputs=tower_inputs)


def view_digest(arrays: list[np.ndarray]) -> str:
    """sha256 of one image's views: its pixel values and its rows of the tower's other
    inputs (two images of equal pixels but other patch grids are different images)."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def read_qwen_images(processor: QwenVisionProcessor, sources: list) -> ImageInputs:
    """Qwen's images -> ``ImageInputs``: one run of patches per image, in ``grid_thw``'s
    order; an image's digest covers its grid too (equal bytes cut another way differ)."""
    pixel_values, grids = processor.preprocess(sources)
    starts = np.cumsum([0, *(int(np.prod(grid)) for grid in grids)])  # each image's first patch
    digests = tuple(view_digest([grid, pixel_values[a:b]]) for grid, a, b in zip(grids, starts[:-1], starts[1:]))
    return ImageInputs(pixel_values=pixel_values,
                       tokens_per_image=tuple(qwen_tokens_per_image(grids, processor.settings.merge_size)),
                       rows=(0,) * len(grids), cols=(0,) * len(grids), digests=digests,
                       tower_inputs={"grid_thw": grids})


def joined(parts: list[ImageInputs]) -> ImageInputs:
    """Several prompts' worth of images as one, in order (each read on its own, so that a
    refusal names its image)."""
    shapes = {part.pixel_values.shape[1:] for part in parts}
    if len(shapes) > 1:
        raise UserError("these images resize to different sizes; send them one request at a time")
    tower_inputs = {name: np.concatenate([part.tower_inputs[name] for part in parts]) for name in parts[0].tower_inputs}
    return ImageInputs(pixel_values=np.concatenate([part.pixel_values for part in parts]), tower_inputs=tower_inputs,
                       **{name: sum((getattr(part, name) for part in parts), ())
                          for name in ("tokens_per_image", "rows", "cols", "digests", "whole_tokens")})


def image_token_counts(prompt: list[int], image_token_id: int) -> list[int]:
    """(L + 1,) how many image tokens come before each position of ``prompt`` (and its end)."""
    counts = [0]
    for token in prompt:
        counts.append(counts[-1] + (token == image_token_id))
    return counts


__all__ = ["ImageInputs", "image_token_counts", "joined", "read_images", "read_qwen_images"]
