"""Images in requests: where every API's image becomes bytes, and a prompt with images
becomes the engine's ids and ``ImageInputs``.

A request names an image by a ``data:`` URL (OpenAI's ``image_url``, the Responses API's
``input_image``), by plain base64 (Ollama's ``images``, Anthropic's ``base64`` source) or,
only when the server was started with ``--allow-local-images``, by a ``file://`` path. An
http(s) URL is refused: the server fetches nothing. Decoding, preprocessing and every
refusal (not an image, a truncated file, a decompression bomb, an image for a text-only
model, more tokens than the context) happen here, before the request reaches the engine,
each as a 400 that names the field.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..engine.images import ImageInputs, joined, read_images
from ..errors import UserError
from ..tokenizer.qwen_processor import QwenVisionProcessor
from ..tokenizer.vision_processor import VisionProcessor
from .errors import APIError, invalid

MAX_IMAGES = 32
BIDIRECTIONAL_KINDS = ("gemma3",)  # image prompt kinds whose image tokens see each other both ways  # per request: each is preprocessed and encoded before the answer starts


def base64_image(data: str, param: str) -> bytes:
    """Plain base64 (whitespace allowed) -> the image's bytes; anything else a 400."""
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(param, f"{param}: the image is not valid base64") from None


def image_bytes(url: str, param: str, allow_local: bool) -> bytes | Path:
    """An image URL -> its bytes (``data:``) or its path (``file://``, when allowed)."""
    if url.startswith("data:"):
        header, comma, data = url[len("data:"):].partition(",")
        if not comma or not header.endswith(";base64"):
            raise invalid(param, f"{param}: a data URL must be base64 (data:image/png;base64,...)")
        return base64_image(data, param)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        if not allow_local:
            raise invalid(param, f"{param}: local files are refused unless the server runs with --allow-local-images")
        return Path(unquote(urlparse(url).path))
    if scheme in ("http", "https"):
        raise invalid(param, f"{param}: the server does not fetch image URLs (it is offline): send a data: URL")
    raise invalid(param, f"{param}: an image is a data: URL (or file:// with --allow-local-images), not {url[:40]!r}")


def check_takes_images(serving, param: str) -> VisionProcessor | QwenVisionProcessor:
    """The serving model's processor, or a 400 when it reads text only (or its images are
    not in the batching engine yet)."""
    if isinstance(serving.tokenizer, QwenVisionProcessor):  # its rows carry their M-RoPE positions (engine/rows.py)
        return serving.tokenizer
    if not isinstance(serving.tokenizer, VisionProcessor):
        raise invalid(param, f"{param}: this model ({serving.model_type or 'text-only'}) reads text only: it takes "
                      "no images", code="images_not_supported")
    if serving.tokenizer.image_prompt.kind in BIDIRECTIONAL_KINDS:  # the engine refuses them too (engine/rows.py)
        raise invalid(param, f"{param}: {serving.model_type}'s image tokens attend to each other both ways, which the "
                      "batching engine does not do yet: use mlx-tfm generate --image", code="images_not_supported")
    return serving.tokenizer


def image_inputs(serving, sources: list[tuple[bytes | Path, str]]) -> ImageInputs:
    """Each image (its bytes or path, the field it came from) preprocessed, or a 400
    naming the field of the first that is not a readable image."""
    processor = check_takes_images(serving, f"{sources[0][1]}.type")
    if len(sources) > MAX_IMAGES:
        raise invalid(sources[MAX_IMAGES][1], f"at most {MAX_IMAGES} images per request, got {len(sources)}")
    parts = []
    for source, param in sources:  # one at a time, so that a refusal names its field
        try:
            parts.append(read_images(processor, [source]))
        except UserError as error:
            raise invalid(param, f"{param}: {error}", code="invalid_image") from None
    try:
        return joined(parts)
    except UserError as error:
        raise invalid(sources[0][1], str(error), code="invalid_image") from None


def image_prompt_ids(serving, text: str, images: ImageInputs, param: str) -> list[int]:
    """``text`` (the rendered prompt, one placeholder per image) with the images' tokens
    written out, encoded as the chat template's text is (no special tokens added)."""
    try:
        expanded = images.expand(serving.tokenizer, text)
    except UserError as error:
        raise invalid(param, str(error)) from None
    ids = serving.tokenizer.encode(expanded, add_special_tokens=False)
    if serving.context is not None and len(ids) >= serving.context:
        raise APIError(400, f"the prompt with its {len(images)} image(s) is {len(ids)} tokens but the model's context "
                       f"is {serving.context}: use fewer or smaller images", param=param,
                       code="context_length_exceeded")
    return ids


__all__ = ["MAX_IMAGES", "base64_image", "check_takes_images", "image_bytes", "image_inputs", "image_prompt_ids"]
