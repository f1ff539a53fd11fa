"""``QwenVisionProcessor``: Qwen2-VL's and Qwen2.5-VL's tokenizer that also prepares images,
as transformers' ``Qwen2VLProcessor`` does: each image's one ``<|image_pad|>`` in the text
becomes one token per merged patch, and the images become the tower's patches with their
grids (``qwen_images.py``).

``prepare_inputs(text, images)`` -> (token ids, pixel values (patches, C * T * P * P),
``{"grid_thw": (n_images, 3)}``), the last being what ``VisionLanguageModel.encode_images``
and ``rope_positions`` take besides the pixels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..jsonfile import read_json
from . import Tokenizer
from .images import load_image
from .qwen_images import QwenImageSettings, expand_image_tokens, preprocess_images

IMAGE_TOKEN = "<|image_pad|>"
# What Qwen's chat template writes for an image: the pad between the vision markers
IMAGE_BLOCK = f"<|vision_start|>{IMAGE_TOKEN}<|vision_end|>"
QWEN_PROCESSOR_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


class QwenVisionProcessor(Tokenizer):
    """A ``Tokenizer`` (everything text works as before) with Qwen's image ``settings``."""

    def __init__(self, tokenizer: Tokenizer, settings: QwenImageSettings):
        super().__init__(tokenizer._backend, tokenizer.bos_token_id, tokenizer.eos_token_ids,
                         tokenizer.special_tokens, tokenizer.chat_template)
        self.settings = settings

    @property
    def placeholder(self) -> str:
        """What a prompt writes where an image goes."""
        return IMAGE_TOKEN

    def prepare_inputs(self, text: str, images: list) -> tuple[list[int], np.ndarray, dict]:
        """``text`` with one ``<|image_pad|>`` per image (none written: each image goes
        first, between its vision markers) -> (token ids, pixel values, image inputs)."""
        pixel_values, grids = self.preprocess(images)
        return self.encode(self.expand_images(text, grids), add_special_tokens=False), pixel_values, {"grid_thw": grids}

    def preprocess(self, images: list) -> tuple[np.ndarray, np.ndarray]:
        """Images (paths, encoded bytes or PIL images) -> (pixel values (patches, C * T * P
        * P), ``grid_thw`` (n_images, 3)); what is not a readable image is a ``UserError``."""
        return preprocess_images([load_image(image) for image in images], self.settings)

    def expand_images(self, text: str, grids: np.ndarray) -> str:
        """``text`` with each ``<|image_pad|>`` written out as its image's tokens (none
        written: the images go first, each between its vision markers)."""
        if len(grids) and self.placeholder not in text:
            text = IMAGE_BLOCK * len(grids) + text
        return expand_image_tokens(text, grids, self.settings.merge_size, IMAGE_TOKEN)

    def prepare(self, text: str, images: list) -> tuple[list[int], np.ndarray]:
        """(token ids, pixel values), as ``VisionProcessor.prepare``; the tower also needs
        the grids, which ``prepare_inputs`` returns."""
        ids, pixel_values, _ = self.prepare_inputs(text, images)
        return ids, pixel_values

    def image_message(self, text: str, n_images: int) -> dict:
        """A user message with ``n_images`` images before ``text``: content parts, which
        Qwen's chat template writes as ``<|vision_start|><|image_pad|><|vision_end|>``."""
        if self.chat_template and "image" in self.chat_template:
            return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}
        return {"role": "user", "content": IMAGE_BLOCK * n_images + text}


def read_qwen_processor(folder: Path, tokenizer: Tokenizer) -> QwenVisionProcessor | None:
    """The processor of a Qwen2-VL / Qwen2.5-VL folder from its preprocessor_config.json
    (or transformers 5's processor_config.json holding it as ``image_processor``); None
    without either: then it reads text only."""
    processor_path, path = Path(folder) / "processor_config.json", Path(folder) / "preprocessor_config.json"
    processor = read_json(processor_path) if processor_path.is_file() else {}
    settings = read_json(path) if path.is_file() else processor.get("image_processor")
    if settings is None:
        return None
    return QwenVisionProcessor(tokenizer, QwenImageSettings.from_dict(settings))
