"""Fine-tuning data with images, for the image-text models (``VisionLanguageModel``).

Rows of ``train.jsonl`` / ``valid.jsonl`` / ``test.jsonl`` in either of two shapes:

- OpenAI chat: ``{"messages": [{"role": "user", "content": [{"type": "image_url",
  "image_url": {"url": "cat.png" | "data:image/png;base64,..."}}, {"type": "text", "text":
  "..."}]}, {"role": "assistant", "content": "..."}]}``; ``{"type": "image", "image":
  "cat.png"}`` parts too.
- mlx-vlm's: ``{"image" | "images": "cat.png" | [...], "question" | "prompt": "...",
  "answer" | "caption" | "completion": "..."}``, or its ``"messages"`` / ``"conversations"``
  with the images in ``"images"`` (they go before the first user message's text unless
  the messages hold bare ``{"type": "image"}`` parts, which take them in order).

A relative image path is read from the data folder. Each row becomes an ``ImageExample``:
its tokens with every image placeholder expanded into the image's tokens, the prompt's
length (everything before the last turn, for ``--mask-prompt``) and its pixel values.
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..datasets import read_jsonl, with_eos
from ..errors import UserError
from ..tokenizer.images import load_image
from ..tokenizer.vision_processor import VisionProcessor
from .data import Batch, LengthGroupedBatches, pad_batch

QUESTION_KEYS = ("question", "prompt")
ANSWER_KEYS = ("answer", "caption", "completion")
IMAGE_KEYS = ("images", "image")
# processors whose towers take more than the pixels and whose training is not built (or not
# yet checked against the generate path); Qwen's processor is not a VisionProcessor at all
UNTRAINED_KINDS = ("pixtral", "gemma4")


class ImageExample(NamedTuple):
    """A text example's (tokens, prompt_length) and the pixel values of its images."""

    tokens: list[int]
    prompt_length: int
    pixel_values: np.ndarray | None  # (n_views, C, H, W) float32; None: a text-only row
    # encode_images' other inputs, a row per view (LLaVA-NeXT's image_sizes, LFM2-VL's spatial_shapes)
    tower_inputs: dict | None = None


# -- where a row's images are ---------------------------------------------------------


def image_source(value, folder: Path, where: str):
    """A path (relative: to the data folder), ``file://`` path or base64 ``data:`` URL ->
    what ``load_image`` reads (a path or the encoded bytes)."""
    if isinstance(value, dict):  # {"url": ...} of image_url, or {"path": ...} of HF datasets
        value = value.get("url", value.get("path"))
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: an image must be a path or a data URL, not {value!r}")
    if value.startswith("data:"):
        header, _, payload = value.partition(",")
        if not header.endswith(";base64"):
            raise UserError(f"{where}: a data URL image must be base64 encoded")
        try:
            return base64.b64decode(payload, validate=True)
        except ValueError:
            raise UserError(f"{where}: the data URL's image is not valid base64") from None
    if value.startswith(("http://", "https://")):
        raise UserError(f"{where}: images are read from files here, not from {value}")
    path = Path(value.removeprefix("file://")).expanduser()
    return path if path.is_absolute() else folder / path


def read_image(value, folder: Path, where: str):
    """The RGB image a row names; a missing or unreadable file is one line naming the row."""
    try:
        return load_image(image_source(value, folder, where))
    except UserError as error:
        message = str(error)
        raise UserError(message if message.startswith(where) else f"{where}: {message}") from None


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def row_has_images(record: dict) -> bool:
    """Whether a row names any image (the test for rows sent to a text-only model)."""
    if any(record.get(key) for key in IMAGE_KEYS):
        return True
    messages = record.get("messages") or record.get("conversations") or []
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(is_image_part, m["content"]))
               for m in (messages if isinstance(messages, list) else []))


# -- a row -> its conversation and images -----------------------------------------------

ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant"}  # mlx-vlm's "conversations"


def row_messages(record: dict, where: str) -> list[dict]:
    """The row's conversation as [{"role", "content"}], whichever shape it came in."""
    messages = record.get("messages", record.get("conversations"))
    if messages is None:
        question = next((record[k] for k in QUESTION_KEYS if k in record), None)
        answer = next((record[k] for k in ANSWER_KEYS if k in record), None)
        if question is None or answer is None:
            keys = ", ".join(sorted(record)) or "none"
            raise UserError(f'{where}: expected "messages" or "question"/"prompt" + "answer"/"caption" beside '
                            f'"image", found keys: {keys}')
        return [{"role": "user", "content": str(question)}, {"role": "assistant", "content": str(answer)}]
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list')
    normalized = []
    for message in messages:
        if not isinstance(message, dict) or message.get("content", message.get("value")) is None:
            raise UserError(f"{where}: every message needs a role and a content")
        role = str(message.get("role", message.get("from", "user")))
        normalized.append({"role": ROLE_ALIASES.get(role.lower(), role),
                           "content": message.get("content", message.get("value"))})
    return normalized


def content_parts(content, where: str) -> list:
    """A message's content -> parts: ("text", str) or ("image", source or None: a bare
    ``{"type": "image"}`` that takes the row's next ``"images"`` entry)."""
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list):
        raise UserError(f"{where}: a message's content must be text or a list of parts")
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(("text", str(part.get("text", ""))))
        elif isinstance(part, dict) and part.get("type") == "image_url":
            parts.append(("image", part.get("image_url")))
        elif isinstance(part, dict) and part.get("type") == "image":
            parts.append(("image", part.get("image", part.get("url", part.get("path")))))
        else:
            raise UserError(f"{where}: unknown content part {part!r} (text, image_url or image)")
    return parts


def conversation_and_images(record: dict, folder: Path, where: str) -> tuple[list[dict], list]:
    """(messages whose content is a list of parts, the row's images read in prompt order)."""
    listed = record.get("images", record.get("image"))
    listed = [] if listed is None else listed if isinstance(listed, list) else [listed]
    messages = [{"role": m["role"], "content": content_parts(m["content"], where)} for m in row_messages(record, where)]
    image_parts = [p for m in messages for p in m["content"] if p[0] == "image"]
    bare = sum(source is None for _, source in image_parts)
    if listed and not image_parts:  # mlx-vlm: the images open the first user message
        first = next((m for m in messages if m["role"] == "user"), messages[0])
        first["content"] = [("image", None)] * len(listed) + first["content"]
        bare = len(listed)
    if bare != len(listed):
        raise UserError(f'{where}: {bare} image part(s) without a source for {len(listed)} "images" entries')
    queue = iter(listed)
    for message in messages:
        message["content"] = [("image", read_image(next(queue) if source is None else source, folder, where))
                              if kind == "image" else (kind, source) for kind, source in message["content"]]
    images = [source for m in messages for kind, source in m["content"] if kind == "image"]
    return messages, images


def rendered(messages: list[dict], processor) -> list[dict]:
    """Messages as the chat template takes them: image parts where it reads them, else
    the processor's placeholder written into the text (as ``VisionProcessor.image_message``)."""
    reads_parts = bool(processor.chat_template) and "image" in processor.chat_template
    out = []
    for message in messages:
        if reads_parts:
            content = [{"type": "image"} if kind == "image" else {"type": "text", "text": value}
                       for kind, value in message["content"]]
        else:
            content = "".join(processor.placeholder if kind == "image" else value for kind, value in message["content"])
        out.append({"role": message["role"], "content": content})
    return out


def encode_image_row(record: dict, processor, folder: Path, where: str) -> ImageExample:
    """One row -> its tokens (image placeholders expanded), the prompt's length (all but
    the last turn, with the generation prompt) and the pixel values of its images."""
    messages, images = conversation_and_images(record, folder, where)
    if images and not (isinstance(processor, VisionProcessor) and processor.processing.kind not in UNTRAINED_KINDS):
        raise UserError(f"{where}: fine-tuning on this model's images is not built yet (Qwen's grids and M-RoPE "
                        "positions, Pixtral's image sizes, Gemma 4's positions)")
    n_prompt_images = sum(kind == "image" for m in messages[:-1] for kind, _ in m["content"])
    full = processor.apply_chat_template(rendered(messages, processor), add_generation_prompt=False, tokenize=False)
    prompt = processor.apply_chat_template(rendered(messages[:-1], processor), add_generation_prompt=True,
                                           tokenize=False)
    try:
        tokens, pixel_values, tower_inputs = processor.prepare_inputs(full, images)
        prompt_tokens, _ = processor.prepare(prompt, images[:n_prompt_images])
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    pixels = pixel_values.astype(np.float32) if images else None
    return ImageExample(with_eos(list(tokens), processor.eos_token_id), len(prompt_tokens), pixels,
                        tower_inputs if images else None)


# -- a split ------------------------------------------------------------------------------


def encode_any_row(record: dict, processor, folder: Path, where: str) -> ImageExample:
    """A row with images (or in mlx-vlm's shape) -> ``encode_image_row``; a plain text row
    in any of the text formats -> a text-only example."""
    from ..datasets import encode_record

    mlx_vlm_shaped = any(key in record for key in ("conversations", "question", "answer", "caption"))
    messages = record.get("messages")
    has_parts = isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                                   for m in messages)
    if row_has_images(record) or mlx_vlm_shaped or has_parts:
        return encode_image_row(record, processor, folder, where)
    tokens, prompt_length = encode_record(record, processor, where)
    return ImageExample(tokens, prompt_length, None)


def load_image_split(folder: Path, split: str, processor, image_token_id: int, max_seq_length: int | None = None,
                     mask_prompt: bool = False) -> list[ImageExample]:
    """Read and encode ``folder/split.jsonl`` for an image-text model (``image_token_id``:
    its image token); without ``mask_prompt`` every target counts (prompt length 0)."""
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise UserError(f"data folder {folder} has no {split}.jsonl")
    examples = [encode_any_row(record, processor, Path(folder), f"{path}:{n}") for n, record in read_jsonl(path)]
    if not examples:
        raise UserError(f"{path} has no examples")
    if max_seq_length:
        examples = truncated(examples, max_seq_length, path, image_token_id)
    return [e if mask_prompt else e._replace(prompt_length=0) for e in examples]


def truncated(examples: list[ImageExample], max_seq_length: int, path: Path, image_token_id: int) -> list:
    """Examples cut to ``max_seq_length`` tokens (one warning); a cut through an image's
    tokens is refused, naming the row."""
    long = [i for i, e in enumerate(examples) if len(e.tokens) > max_seq_length]
    for i in long:
        if image_token_id in examples[i].tokens[max_seq_length:]:
            raise UserError(f"{path}: example {i + 1}'s image tokens run past --max-seq-length {max_seq_length} "
                            f"(it has {len(examples[i].tokens)} tokens): raise it or use smaller images")
    if long:
        print(f"warning: {len(long)} of {len(examples)} examples in {path} are longer than --max-seq-length "
              f"{max_seq_length}; they are truncated", file=sys.stderr)
    return [e._replace(tokens=e.tokens[:max_seq_length], prompt_length=min(e.prompt_length, max_seq_length))
            for e in examples]


def refuse_images_for_text_model(folder: Path, splits, model_type: str) -> None:
    """A ``UserError`` naming the first row that holds an image, for a model that reads text only."""
    for split in splits:
        path = Path(folder) / f"{split}.jsonl"
        if not path.is_file():
            continue
        for number, record in read_jsonl(path):
            if isinstance(record, dict) and row_has_images(record):
                raise UserError(f"{path}:{number}: this row has an image and the model ({model_type}) reads text "
                                "only: fine-tune an image-text model on it")


# -- batches ------------------------------------------------------------------------------


class ImageBatches(LengthGroupedBatches):
    """``LengthGroupedBatches`` whose batches also carry their rows' pixel values, every
    view of every row in row order (the order the rows' image tokens take them)."""

    def collate(self, examples: list[ImageExample]) -> Batch:
        batch = pad_batch([(e.tokens, e.prompt_length) for e in examples], self.pad_to)
        with_images = [e for e in examples if e.pixel_values is not None]
        if len({e.pixel_values.shape[1:] for e in with_images}) > 1:
            raise UserError("this batch's images resize to different view sizes (Pixtral's): use --batch-size 1")
        views = [e.pixel_values for e in with_images]
        batch.pixel_values = np.concatenate(views) if views else None  # (n_views, C, H, W)
        names = with_images[0].tower_inputs if with_images else None
        batch.tower_inputs = {name: np.concatenate([e.tower_inputs[name] for e in with_images])
                              for name in names} if names else None  # a row per view
        return batch
