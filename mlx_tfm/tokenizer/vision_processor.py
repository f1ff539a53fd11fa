"""``VisionProcessor``: an image-text model's tokenizer that also turns images into its
inputs: ``prepare(text, images)`` -> the prompt's token ids, its image placeholders
expanded (image_tokens.py), and the pixel values of every view (images.py).

``read_vision_processor(folder, tokenizer, config)`` builds it from the folder's
preprocessor_config.json (how pixels are made), processor_config.json (how many tokens an
image takes, where the family keeps that there) and config.json.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..jsonfile import read_json
from . import Tokenizer
from .gemma4_images import preprocess_gemma4_images, read_gemma4_processing
from .image_tokens import ImagePrompt, expand_image_placeholders, read_image_prompt
from .images import ImageProcessing, preprocess_images, read_image_processing
from .llava_next_images import preprocess_llava_next_images
from .lfm2_vl_images import preprocess_lfm2_vl_images, read_lfm2_vl_processing
from .qwen_processor import QWEN_PROCESSOR_TYPES, QwenVisionProcessor, read_qwen_processor
from .pixtral_images import preprocess_pixtral_images, read_pixtral_processing

# model_type -> how its prompt writes an image (image_tokens.KINDS)
PROMPT_KINDS = {"llava": "llava", "llava_next": "llava_next", "idefics3": "idefics3", "smolvlm": "idefics3",
                "gemma3": "gemma3", "mistral3": "pixtral", "gemma4": "gemma4", "lfm2_vl": "lfm2_vl"}
# processing kinds with their own preprocessing (else images.py's), and the tower inputs
# beside the pixel values that it makes for ``encode_images``
PREPROCESSORS = {"pixtral": (preprocess_pixtral_images, ("image_sizes",)),
                 "llava_next": (preprocess_llava_next_images, ("image_sizes",)),
                 "gemma4": (preprocess_gemma4_images, ("image_position_ids",)),
                 "lfm2_vl": (preprocess_lfm2_vl_images, ("spatial_shapes", "pixel_attention_mask"))}


class VisionProcessor(Tokenizer):
    """A ``Tokenizer`` (everything text works as before) with ``processing`` (pixels) and
    ``image_prompt`` (the image's tokens in the prompt)."""

    def __init__(self, tokenizer: Tokenizer, processing: ImageProcessing, image_prompt: ImagePrompt):
        super().__init__(tokenizer._backend, tokenizer.bos_token_id, tokenizer.eos_token_ids,
                         tokenizer.special_tokens, tokenizer.chat_template)
        self.processing = processing
        self.image_prompt = image_prompt

    @property
    def placeholder(self) -> str:
        """What a prompt writes where an image goes (``<image>``, ``<start_of_image>``)."""
        return self.image_prompt.placeholder

    def prepare(self, text: str, images: list) -> tuple[list[int], np.ndarray]:
        """``text`` with one placeholder per image (none written: all images go first) ->
        (token ids, pixel values float32: (n_views, C, H, W), or cut patches for the towers
        that take them)."""
        ids, pixel_values, _ = self.prepare_inputs(text, images)
        return ids, pixel_values

    def prepare_inputs(self, text: str, images: list) -> tuple[list[int], np.ndarray, dict]:
        """As ``prepare``, plus the tower's other inputs for ``encode_images`` (Pixtral's
        ``image_sizes``, LFM2-VL's ``spatial_shapes``; none for the fixed-size towers)."""
        inputs = self.preprocess(images)
        image_inputs = {name: inputs[name] for name in self.tower_input_names}
        if images and self.placeholder not in text:
            text = self.placeholder * len(images) + text
        expanded = expand_image_placeholders(text, self.image_prompt, inputs["rows"], inputs["cols"],
                                             inputs.get("whole_tokens"))
        bos = self.special_tokens.get("bos_token")  # a rendered chat template writes its own
        ids = self.encode(expanded, add_special_tokens=not (bos and expanded.startswith(bos)))
        return ids, inputs["pixel_values"], image_inputs

    def preprocess(self, images: list) -> dict:
        """The family's preprocessing of ``images``: ``pixel_values``, the tower's other
        inputs (``tower_input_names``), ``views``, ``rows``, ``cols`` per image."""
        preprocess, _ = PREPROCESSORS.get(self.processing.kind, (preprocess_images, ()))
        return preprocess(images, self.processing)

    @property
    def tower_input_names(self) -> tuple[str, ...]:
        """The inputs beside the pixel values that ``encode_images`` takes, one row per view."""
        return PREPROCESSORS.get(self.processing.kind, (None, ()))[1]

    def image_message(self, text: str, n_images: int) -> dict:
        """A user message with ``n_images`` images before ``text``: as content parts when
        the chat template reads them, else the placeholders written into the text."""
        if self.chat_template and "image" in self.chat_template:
            return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}
        return {"role": "user", "content": self.placeholder * n_images + text}


def read_vision_processor(folder: Path, tokenizer: Tokenizer, config: dict
                          ) -> VisionProcessor | QwenVisionProcessor | None:
    """The processor of an image-text model folder, or None when the folder has no image
    processor settings (preprocessor_config.json, or transformers 5's processor_config.json
    holding them as ``image_processor``): then it reads text only."""
    model_type = config.get("model_type")
    if model_type in QWEN_PROCESSOR_TYPES:  # Qwen's own processor (qwen_processor.py)
        return read_qwen_processor(folder, tokenizer)
    if model_type not in PROMPT_KINDS:
        raise UserError(f"{model_type!r} models take no images here ({', '.join(PROMPT_KINDS)} do)")
    processor_path, path = Path(folder) / "processor_config.json", Path(folder) / "preprocessor_config.json"
    processor = read_json(processor_path) if processor_path.is_file() else {}
    settings = read_json(path) if path.is_file() else processor.get("image_processor")
    if settings is None:
        return None
    kind = PROMPT_KINDS[model_type]
    if (config.get("vision_config") or {}).get("model_type") == "pixtral":  # Pixtral 12B: a llava
        kind = "pixtral"
    if kind == "gemma4":
        processor = {**gemma4_image_tokens(tokenizer, config), **processor}
    readers = {"pixtral": lambda: read_pixtral_processing(settings, config),
               "gemma4": lambda: read_gemma4_processing(settings),
               "lfm2_vl": lambda: read_lfm2_vl_processing(settings)}
    processing = readers.get(kind, lambda: read_image_processing(settings))()
    if kind == "llava_next":  # how many features a view's side has: the tower's patches, as the prompt counts them
        if processing.kind != "llava_next":
            raise UserError("a llava_next model needs LlavaNextImageProcessor's settings in preprocessor_config.json "
                            f"(its anyres views), not {settings.get('image_processor_type')!r}")
        patch = processor.get("patch_size") or (config.get("vision_config") or {}).get("patch_size", 14)
        processing = dataclasses.replace(processing, patch_size=patch)
    if kind == "lfm2_vl":  # a tile's tokens follow from the image processor's sizes
        processor = {"tokens_per_tile": processing.view_tokens(processing.tile_size, processing.tile_size), **processor}
    return VisionProcessor(tokenizer, processing, read_image_prompt(kind, processor, config))


def gemma4_image_tokens(tokenizer: Tokenizer, config: dict) -> dict:
    """Gemma 4's image, begin and end token texts: its tokenizer's spelling of config.json's ids."""
    ids = {"image_token": config.get("image_token_id", 258880), "boi_token": config.get("boi_token_id", 255999),
           "eoi_token": config.get("eoi_token_id", 258882)}
    return {name: tokenizer.id_to_token(token_id) for name, token_id in ids.items()}
