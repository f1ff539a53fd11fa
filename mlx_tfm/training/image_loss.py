"""The fine-tuning loss of an image-text model (``VisionLanguageModel``) on batches with
images: the tower and projector encode every view of the batch, the features take the
image tokens' places row by row, and the language model is scored as in ``loss_fn``.

Image tokens are never targets: they stand for pixels, not for text to predict (and their
id may lie past the vocabulary). The step is compiled, so the features are placed without
reading a count back from the arrays (the data side made the tokens and views agree).
"""

from __future__ import annotations

import mlx.core as mx

from ..model.vision_language import with_image_blocks
from .trainer import cross_entropy_sum, target_mask


def features_in_place(embeddings: mx.array, is_image: mx.array, features: mx.array) -> mx.array:
    """``embeddings`` (B, L, D) with the image positions ``is_image`` (B, L) taking
    ``features`` (n_image_tokens, D) in row-major order."""
    B, L, D = embeddings.shape
    flat = is_image.reshape(-1)  # (B * L,)
    order = mx.maximum(mx.cumsum(flat.astype(mx.int32)) - 1, 0)  # the feature each image token takes
    placed = features.astype(embeddings.dtype)[order].reshape(B, L, D)  # (B, L, D)
    return mx.where(is_image[..., None], placed, embeddings)


def image_hidden_states(model, inputs: mx.array, pixel_values: mx.array | None,
                        tower_inputs: dict | None = None) -> mx.array:
    """The language model's last hidden states (B, L, D) over ``inputs`` (B, L) whose image
    tokens read the features of ``pixel_values`` (n_views, C, H, W) and ``tower_inputs``."""
    if pixel_values is None:
        return model.model(inputs)
    is_image = inputs == model.vision_args.image_token_id
    features = model.encode_images(pixel_values, **(tower_inputs or {}))  # (n_image_tokens, D)
    embeddings = features_in_place(model.embed_tokens(inputs, is_image), is_image, features)
    mask = None
    if model.vision_args.image_attention == "bidirectional":  # Gemma 3: an image's tokens see each other
        masks = model.model._stack_masks(None, inputs.shape[1], None, embeddings.dtype)
        mask = [with_image_blocks(m, is_image, 0) for m in masks]
    return model.model(inputs, mask, input_embeddings=embeddings)


def image_loss(model, tokens: mx.array, lengths: mx.array, pixel_values: mx.array | None = None,
               tower_inputs: dict | None = None):
    """Mean next-token cross-entropy over the counted text targets of rows (B, T) with
    their (prompt_length, length) (B, 2) and images (and the tower's other inputs, a row
    per view), and how many targets there were."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    image_targets = targets == model.vision_args.image_token_id
    mask = target_mask(lengths, targets.shape[1]) & ~image_targets
    targets = mx.where(image_targets, 0, targets)  # an id inside the vocabulary; masked out anyway
    ntoks = mask.sum()
    hidden = image_hidden_states(model, inputs, pixel_values, tower_inputs)  # (B, L, D)
    return cross_entropy_sum(model, hidden, targets, mask) / mx.maximum(ntoks, 1), ntoks
