"""A vision-language model: a vision tower, a projector, and the one language model.

``encode_images(pixel_values, **image_inputs)`` runs the tower over every view (an image,
or Idefics3's tiles and global view) and the projector, and returns one row per image token
(n_image_tokens, D); LLaVA-NeXT's views of one image are packed back into its grid
(model/anyres.py). A tower is any module ``tower(pixel_values, **image_inputs)`` ->
(n_views, positions, D_vision) and a projector any ``projector(states)`` -> (n_views, tokens,
D), so towers with extra inputs (Qwen's grid_thw) fit the same call.

``model(tokens, cache=cache, image_features=features)`` embeds the text tokens, puts the
image features at the image-token positions (in order), and runs the language model on
those embeddings; with Gemma 3 (``image_attention`` "bidirectional") the tokens of one image
also see each other during that forward pass. The KV cache is the language model's own, so
what follows the prompt is plain text decoding: ``model(tokens, cache=cache)``.

Qwen's models (``vision`` holds ``qwen_tower``): the tower is Qwen's own
(``qwen_vision.py``, ``qwen3_vision.py``), whose merger is the projector; it takes the
patches with ``grid_thw``. Their language model turns by M-RoPE positions: pass
``positions`` (3, B, L) to every call while the sequence holds images, the prompt's from
``rope_positions(prompt, grid_thw)`` and then ``mrope.decode_positions(offset,
[rope_delta])`` (``generation/images.py`` does both). Qwen3-VL's image features carry its
DeepStack features side by side, (n_image_tokens, (1 + n_deepstack) * D), added to the
image tokens' states after the first layers.

Shapes: B batch, L positions, S keys, D the language model's width.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from .anyres import pack_anyres_features
from .cache import window_mask
from .config import ModelArgs
from .mixers import ATTENTION_TYPES
from .mrope import ExplicitPositions, batch_positions
from .positions import rope_type
from .projectors import make_projector
from .qwen3_vision import make_qwen_tower, split_deepstack
from .qwen_vision import QwenVisionArgs
from .transformer import Model
from .vision_args import VisionArgs
from .vision_tower import VisionTower


def scatter_image_features(embeddings: mx.array, is_image: mx.array, features: mx.array) -> mx.array:
    """``embeddings`` (B, L, D) with the rows where ``is_image`` (B, L) is True replaced,
    row-major, by ``features`` (n_image_tokens, D), whose count must match."""
    B, L, D = embeddings.shape
    n_tokens, n_features = int(is_image.sum().item()), features.shape[0]
    if n_tokens != n_features:
        raise ValueError(f"the prompt has {n_tokens} image tokens for {n_features} image features")
    flat = is_image.reshape(-1)  # (B * L,)
    order = mx.maximum(mx.cumsum(flat.astype(mx.int32)) - 1, 0)  # which feature each image token takes
    placed = features.astype(embeddings.dtype)[order].reshape(B, L, D) if n_features else embeddings
    return mx.where(is_image[..., None], placed, embeddings)


def image_blocks(is_image: mx.array) -> mx.array:
    """(B, L) -> (B, L) int: the index of the run of image tokens each position is in, -1
    for text. Consecutive image tokens are one image."""
    as_int = is_image.astype(mx.int32)
    before = mx.concatenate([mx.zeros_like(as_int[:, :1]), as_int[:, :-1]], axis=1)
    starts = as_int * (1 - before)  # 1 where a run begins
    return mx.where(is_image, mx.cumsum(starts, axis=1) - 1, -1)


def with_image_blocks(mask, is_image: mx.array, offset: int) -> mx.array:
    """A layer's mask (``"causal"`` or boolean (L, S), the chunk's queries last of S keys;
    ``offset`` positions before it) widened so that each image's tokens in this chunk see
    each other: (B, 1, L, S)."""
    B, L = is_image.shape
    if isinstance(mask, str) or mask is None:
        mask = window_mask(mx.arange(offset, offset + L), mx.arange(offset + L), None)
    S = mask.shape[-1]
    blocks = image_blocks(is_image)
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)  # (B, L, L)
    same = mx.concatenate([mx.zeros((B, L, S - L), mx.bool_), same], axis=2)  # (B, L, S)
    return (mask.reshape(-1, L, S) | same)[:, None]  # (B, 1, L, S)


class VisionLanguageModel(nn.Module):
    """``language_model`` (a decoder ``Model``), ``vision_tower``, ``multi_modal_projector``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vision is None:
            raise ValueError("a vision-language model needs its tower's arguments (vision)")
        self.args = args
        self.vision_args = VisionArgs.from_dict(args.vision)
        self.language_model = Model(dataclasses.replace(args, vision=None))
        if self.vision_args.qwen_tower is not None:  # Qwen's tower ends in its own merger
            self.vision_tower = make_qwen_tower(QwenVisionArgs.from_fields(self.vision_args.qwen_tower))
            self.multi_modal_projector = nn.Identity()
            return
        tower = self.vision_args.tower_args()
        self.vision_tower = VisionTower(tower, self.vision_args)
        self.multi_modal_projector = make_projector(self.vision_args, tower, args)
        if self.vision_args.image_grid_pinpoints:  # LLaVA-NeXT: ends each packed row of an image's features
            self.image_newline = mx.zeros((args.hidden_size,))

    def encode_images(self, pixel_values: mx.array, **image_inputs) -> mx.array:
        """Pixel values (n_views, C, H, W) -> image features (n_image_tokens, D), in the
        order the prompt's image tokens take them. Qwen's tower: pixel values (patches,
        C * T * P * P) with ``grid_thw`` (n_images, 3), as its processor prepares them.
        LLaVA-NeXT: with ``image_sizes`` (n_views, 2), each view's image's original
        (height, width), by which its views are packed into one grid (model/anyres.py)."""
        if self.vision_args.image_grid_pinpoints:
            image_sizes = image_inputs.pop("image_sizes")
        states = self.vision_tower(pixel_values, **image_inputs)
        features = self.multi_modal_projector(states)  # (n_views, tokens, D)
        if self.vision_args.image_grid_pinpoints:
            return pack_anyres_features(features, image_sizes, self.vision_args.image_grid_pinpoints,
                                        self.vision_args.image_size, self.image_newline)
        return features.reshape(-1, features.shape[-1])

    def __call__(self, inputs: mx.array, mask=None, cache: list | None = None,
                 image_features: mx.array | None = None, positions: mx.array | None = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab_size); ``image_features`` (from
        ``encode_images``) fill the image tokens' places. ``positions`` (3, B, L): M-RoPE's
        positions of these tokens (``rope_positions``), for Qwen's models whenever the
        sequence holds images, prompt and decoding alike; None: the cache's offset."""
        if image_features is None:
            return self.language_model(inputs, mask, cache, positions=positions)
        is_image = inputs == self.vision_args.image_token_id
        n_deepstack = len((self.vision_args.qwen_tower or {}).get("deepstack_visual_indexes") or ())
        if n_deepstack:  # Qwen3-VL: the rows hold the DeepStack features beside the merged ones
            image_features, deepstack = split_deepstack(image_features, n_deepstack)
        embeddings = scatter_image_features(self.embed_tokens(inputs, is_image), is_image, image_features)
        if n_deepstack:
            return self.deepstack_forward(embeddings, is_image, deepstack, mask, cache, positions)
        if self.vision_args.image_attention == "bidirectional" and mask is None and inputs.shape[1] > 1:
            stack, offset = self.language_model.model, cache[0].offset if cache is not None else 0
            # the masks the stack would build from the caches, then each image's block opened
            masks = stack._stack_masks(None, inputs.shape[1], cache, embeddings.dtype)
            mask = [with_image_blocks(m, is_image, offset) for m in masks]
        return self.language_model(inputs, mask, cache, input_embeddings=embeddings, positions=positions)

    def deepstack_forward(self, embeddings: mx.array, is_image: mx.array, deepstack: list[mx.array], mask,
                          cache: list | None, positions: mx.array | None) -> mx.array:
        """The language model's layers over ``embeddings`` (B, L, D), each DeepStack
        feature (n_image_tokens, D) added to the image tokens' states after the layer of
        its number (Qwen3-VL); the masks and positions as the stack gives them."""
        stack = self.language_model.model
        masks = stack._stack_masks(mask, embeddings.shape[1], cache, embeddings.dtype)
        caches = cache if cache is not None else [None] * len(stack.layers)
        if positions is not None:
            caches = [ExplicitPositions(layer_cache, positions) if kind in ATTENTION_TYPES else layer_cache
                      for layer_cache, kind in zip(caches, self.args.layer_types)]
        h = embeddings
        for i, (layer, layer_cache) in enumerate(zip(stack.layers, caches)):
            h = layer(h, masks[i], layer_cache)
            if i < len(deepstack):
                h = h + scatter_image_features(mx.zeros_like(h), is_image, deepstack[i])
        return self.language_model.head(stack.norm(h))

    def rope_positions(self, prompt: list[int], image_grid_thw) -> tuple[mx.array, int] | None:
        """M-RoPE's positions (3, 1, L) of a prompt whose images have ``image_grid_thw``
        (n, 3), and its rope_delta: the tokens after the prompt take
        ``mrope.decode_positions(offset, [rope_delta])``. None for a model without M-RoPE."""
        if self.vision_args.qwen_tower is None or rope_type(self.args.rope_scaling) != "mrope":
            return None
        merge = self.vision_args.qwen_tower["spatial_merge_size"]
        positions, deltas = batch_positions([list(prompt)], self.vision_args.image_token_id, image_grid_thw, merge)
        return positions, deltas[0]

    def embed_tokens(self, inputs: mx.array, is_image: mx.array) -> mx.array:
        """The text embeddings (B, L, D), scaled as the language model scales them; image
        tokens are looked up as token 0 (their id may lie past the table)."""
        stack = self.language_model.model
        h = stack.embed_tokens(mx.where(is_image, 0, inputs))
        if self.args.embedding_scale is not None:
            h = h * mx.array(self.args.embedding_scale, dtype=h.dtype)
        return h

    def head(self, h: mx.array) -> mx.array:
        return self.language_model.head(h)

    @property
    def model(self):
        """The language model's stack (``model.*`` of a decoder), for code that reads it."""
        return self.language_model.model

    @property
    def lm_head(self) -> nn.Module:
        """The language model's untied head (training reads it as a decoder's)."""
        return self.language_model.lm_head

    @property
    def layers(self) -> list:
        return self.language_model.layers

    def make_cache(self, max_kv_size: int | None = None, keep: int = 0) -> list:
        return self.language_model.make_cache(max_kv_size, keep)
