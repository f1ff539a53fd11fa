"""An image's place in the prompt: each placeholder the text (or the chat template) writes
is expanded into the tokens the model's image features will replace, as transformers'
processors do:

- LLaVA: ``<image>`` -> ``<image>`` once per patch the projector keeps;
- LLaVA-NeXT: ``<image>`` -> as LLaVA's for the whole-image view, then one per feature of the
  unpadded grid and one per row for its newline (``rows x cols``: llava_next_images.py);
- Idefics3 / SmolVLM: ``<image>`` -> for each tile ``<fake_token_around_image><row_r_col_c>``
  plus ``image_seq_len`` ``<image>`` tokens, a newline after each row of tiles, then
  ``\\n<fake_token_around_image><global-img>``, the global view's tokens and a closing
  ``<fake_token_around_image>`` (one image that fits one tile: only the global part);
- Gemma 3: ``<start_of_image>`` -> ``\\n\\n<start_of_image>``, ``mm_tokens_per_image`` soft
  tokens ``<image_soft_token>``, ``<end_of_image>\\n\\n``;
- Mistral 3 (Pixtral): ``[IMG]`` -> the image's rows of ``[IMG]`` tokens, each row ended by
  ``[IMG_BREAK]``, the last by ``[IMG_END]`` (pixtral_images.py; ``rows x cols`` its grid);
- Gemma 4: its image token -> the begin token, one image token per soft token (``rows x
  cols``, gemma4_images.py), the end token;
- LFM2-VL: ``<image>`` -> ``<|image_start|>``, each tile's ``<|img_row_r_col_c|>`` and
  tokens and ``<|img_thumbnail|>`` with the thumbnail's (or the one view's tokens),
  ``<|image_end|>`` (lfm2_vl_images.py; ``rows x cols`` its tile grid).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .lfm2_vl_images import lfm2_vl_image_text
from .pixtral_images import pixtral_image_text

KINDS = ("llava", "llava_next", "idefics3", "gemma3", "pixtral", "gemma4", "lfm2_vl")


@dataclass(frozen=True)
class ImagePrompt:
    """How one family writes an image into its prompt (``read_image_prompt`` builds it)."""

    kind: str  # "llava" | "llava_next" | "idefics3" | "gemma3" | "pixtral" | "gemma4" | "lfm2_vl"
    placeholder: str  # what the prompt holds once per image
    image_token: str  # the token whose embeddings the image features replace
    tokens_per_view: int  # image tokens per view (a tile or the whole image)
    begin: str = ""  # "gemma4", "lfm2_vl": the tokens around an image's own
    end: str = ""


def llava_tokens(crop: tuple[int, int], patch_size: int, extra_tokens: int, strategy: str) -> int:
    """LLaVA's image tokens: one per patch, plus the tower's extra tokens (CLS), less the
    one the "default" feature strategy drops."""
    count = (crop[0] // patch_size) * (crop[1] // patch_size) + extra_tokens
    return count - 1 if strategy == "default" else count


def read_image_prompt(kind: str, processor: dict, config: dict) -> ImagePrompt:
    """The family's ``ImagePrompt`` from ``processor_config.json`` (``processor``) and the
    model's ``config.json`` (``config``), with transformers' defaults for what they omit."""
    if kind in ("llava", "llava_next"):
        vision = config.get("vision_config") or {}
        size = vision.get("image_size", 336)
        count = llava_tokens((size, size), processor.get("patch_size") or vision.get("patch_size", 14),
                             processor.get("num_additional_image_tokens", 0),
                             processor.get("vision_feature_select_strategy") or config.get(
                                 "vision_feature_select_strategy", "default"))
        return ImagePrompt(kind, "<image>", "<image>", count)
    if kind == "idefics3":
        return ImagePrompt("idefics3", "<image>", "<image>", processor.get("image_seq_len", 169))
    if kind == "gemma3":
        count = processor.get("image_seq_length") or config.get("mm_tokens_per_image", 256)
        return ImagePrompt("gemma3", "<start_of_image>", "<image_soft_token>", count)
    if kind == "pixtral":  # tokens per image: its own grid (rows x cols)
        token = processor.get("image_token") or "[IMG]"
        return ImagePrompt("pixtral", token, token, 0)
    if kind == "gemma4":  # the token texts: read from the tokenizer by config.json's ids (vision_processor.py)
        token = processor["image_token"]
        return ImagePrompt("gemma4", token, token, 0, processor["boi_token"], processor["eoi_token"])
    if kind == "lfm2_vl":  # tokens per tile: from the image processor's sizes (vision_processor.py)
        marked = processor.get("use_image_special_tokens", True)
        return ImagePrompt("lfm2_vl", "<image>", "<image>", processor["tokens_per_tile"],
                           "<|image_start|>" if marked else "", "<|image_end|>" if marked else "")
    raise UserError(f"unknown image prompt kind {kind!r} ({', '.join(KINDS)})")


def image_text(prompt: ImagePrompt, rows: int = 0, cols: int = 0, whole_tokens: int = 0) -> str:
    """The text one image's placeholder becomes (``rows x cols``: Idefics3's or LFM2-VL's
    tile grid, LLaVA-NeXT's unpadded feature grid; ``whole_tokens``: LFM2-VL's tokens of
    the whole-image view)."""
    if prompt.kind == "lfm2_vl":
        return lfm2_vl_image_text(prompt.image_token, prompt.tokens_per_view, rows, cols, whole_tokens, prompt.begin,
                                  prompt.end)
    if prompt.kind == "pixtral":
        return pixtral_image_text(prompt.image_token, rows, cols)
    if prompt.kind == "gemma4":
        return prompt.begin + prompt.image_token * (rows * cols) + prompt.end
    if prompt.kind == "llava_next":  # each row of the grid ends with the image_newline feature
        return prompt.image_token * (prompt.tokens_per_view + rows * (cols + 1))
    tokens = prompt.image_token * prompt.tokens_per_view
    if prompt.kind == "llava":
        return tokens
    if prompt.kind == "gemma3":
        return f"\n\n<start_of_image>{tokens}<end_of_image>\n\n"
    around = "<fake_token_around_image>"
    global_view = f"{around}<global-img>{tokens}{around}"
    if rows == 0 and cols == 0:
        return global_view
    grid = "".join("".join(f"{around}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{global_view}"


def image_token_count(prompt: ImagePrompt, rows: int = 0, cols: int = 0, whole_tokens: int = 0) -> int:
    """How many image tokens (those the features replace) one image's text holds."""
    return image_text(prompt, rows, cols, whole_tokens).count(prompt.image_token)


def expand_image_placeholders(text: str, prompt: ImagePrompt, rows: list[int], cols: list[int],
                              whole_tokens: list[int] | None = None) -> str:
    """``text`` with its i-th placeholder replaced by image i's tokens; as many
    placeholders as images, else a ``UserError``. ``whole_tokens``: LFM2-VL's per image."""
    pieces = text.split(prompt.placeholder)
    if len(pieces) - 1 != len(rows):
        raise UserError(f"the prompt has {len(pieces) - 1} {prompt.placeholder} placeholder(s) for {len(rows)} "
                        "image(s): write one where each image goes")
    out = [pieces[0]]
    for i, piece in enumerate(pieces[1:]):
        out += [image_text(prompt, rows[i], cols[i], whole_tokens[i] if whole_tokens else 0), piece]
    return "".join(out)
