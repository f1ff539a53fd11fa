"""Images in a prompt: ``bind_images(model, processor, prompt, images)`` encodes the images
once and returns the model bound to them (``ImageBoundModel``, shaped like a decoder-only
model, as T5's ``BoundDecoder`` is) and the prompt's token ids; the decoding loop then runs
unchanged. The forward pass over the prompt's image tokens carries their features, in
whatever chunks the prefill takes; every later token is plain text decoding from the cache.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError
from ..model.mrope import sequence_positions
from ..model.vision_language import VisionLanguageModel
from ..tokenizer import Tokenizer
from ..tokenizer.qwen_processor import QwenVisionProcessor
from ..tokenizer.vision_processor import VisionProcessor


class ImageBoundModel:
    """A vision-language model bound to one prompt's image features:
    ``bound(tokens (B, L), mask=None, cache=None) -> logits``, ``make_cache()``, ``args``.
    A chunk of the prompt gets the features of the image tokens it holds (counted from the
    cache's offset); the tokens after the prompt get none. ``rope``: (the prompt's M-RoPE
    positions (3, 1, L), its rope_delta) for Qwen's models (``rope_positions``), whose
    every token then takes its position from them, the prompt's or ``offset + rope_delta``."""

    def __init__(self, model: VisionLanguageModel, features: mx.array, prompt: list[int],
                 rope: tuple[mx.array, int] | None = None):
        self.model = model
        self.features = features
        self.args = model.args
        is_image = mx.array(prompt) == model.vision_args.image_token_id
        self.image_tokens_before = mx.concatenate([mx.zeros((1,), mx.int32), mx.cumsum(is_image.astype(mx.int32))])
        self.n_prompt = len(prompt)
        self.rope = rope

    def __call__(self, tokens: mx.array, mask=None, cache: list | None = None) -> mx.array:
        offset = cache[0].offset if cache is not None else 0
        positions = self.positions(offset, tokens.shape[1])
        turned = {} if positions is None else {"positions": positions}  # only Qwen's models take M-RoPE positions
        if offset >= self.n_prompt:
            return self.model(tokens, mask, cache, **turned)
        end = min(offset + tokens.shape[1], self.n_prompt)
        first, last = int(self.image_tokens_before[offset].item()), int(self.image_tokens_before[end].item())
        if first == last:
            return self.model(tokens, mask, cache, **turned)
        return self.model(tokens, mask, cache, image_features=self.features[first:last], **turned)

    def positions(self, offset: int, length: int) -> mx.array | None:
        """M-RoPE positions (3, 1, length) of the tokens from ``offset`` on: the prompt's
        own, then (past the prompt) text positions ``rope_delta`` behind the count."""
        return None if self.rope is None else sequence_positions(*self.rope, offset, length)

    def make_cache(self, max_kv_size: int | None = None, keep: int = 0) -> list:
        return self.model.make_cache(max_kv_size, keep)

    @property
    def layers(self) -> list:
        return self.model.layers


def check_takes_images(model, processor: Tokenizer) -> None:
    """A ``UserError`` unless ``model`` is image-text and ``processor`` prepares its images."""
    if not isinstance(model, VisionLanguageModel):
        raise UserError(f"this model ({model.args.model_type}) reads text only: it takes no images")
    if not isinstance(processor, (VisionProcessor, QwenVisionProcessor)):
        raise UserError("this model folder has no preprocessor_config.json, so its images cannot be prepared")


def bind_images(model, processor: Tokenizer, prompt: str, images: list) -> tuple[ImageBoundModel, list[int]]:
    """(the model bound to ``images``' features, the prompt's token ids with each image's
    tokens in place). An image for a text-only model, or a prompt given as token ids, is a
    ``UserError``."""
    check_takes_images(model, processor)
    if not isinstance(prompt, str):
        raise UserError("a prompt with images must be text (its image placeholders are expanded into tokens)")
    ids, pixel_values, image_inputs = processor.prepare_inputs(prompt, images)
    context = model.args.max_position_embeddings
    if len(ids) >= context:
        raise UserError(f"the prompt with its {len(images)} image(s) takes {len(ids)} tokens and the context holds "
                        f"{context}: use fewer or smaller images")
    features = model.encode_images(mx.array(pixel_values), **image_inputs)
    mx.eval(features)
    rope = model.rope_positions(ids, image_inputs["grid_thw"]) if "grid_thw" in image_inputs else None
    return ImageBoundModel(model, features, ids, rope), ids


def image_prompt_text(model, processor: Tokenizer, prompt: str, n_images: int, system_prompt: str | None = None,
                      ignore_chat_template: bool = False) -> str:
    """The prompt as text with ``n_images`` images in its user message: through the chat
    template when the model has one, else the raw text (the processor puts placeholder-less
    images first)."""
    check_takes_images(model, processor)
    if processor.has_chat_template and not ignore_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append(processor.image_message(prompt, n_images))
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # without placeholders the processor puts the images first (in the family's own markers)
    return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
