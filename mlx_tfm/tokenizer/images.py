"""Images into pixel values without torch: loading, resizing, rescaling, normalising.

What transformers' slow (PIL) image processors do, for the families mlx_tfm reads:

- ``"clip"`` (CLIPImageProcessor, LLaVA 1.5): the shortest edge resized to ``size``
  (bicubic), a centre crop of ``crop_size``;
- ``"siglip"`` (SiglipImageProcessor, Gemma3ImageProcessor without pan-and-scan): a resize
  to a fixed height and width;
- ``"idefics3"`` (Idefics3ImageProcessor, SmolVLMImageProcessor): the longest edge resized to
  ``longest_edge``, then up to multiples of ``tile`` (the encoder's ``max_image_size``),
  cut into ``rows x cols`` tiles of ``tile`` plus a global view of the whole image at
  ``tile x tile`` (no tiles when the image fits one).

Every resize runs on the 8-bit image (as transformers does), then the pixels are rescaled
(times ``rescale_factor``, in float64 then float32) and normalised ((x - mean) / std).

``load_image`` opens a path or bytes and refuses, in one line, what is not an image, a
truncated file and a decompression bomb (more than ``MAX_IMAGE_PIXELS`` pixels).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile

from ..errors import UserError

# More pixels than this is refused before decoding (PIL's own default, set here on purpose so
# that no other import can loosen it): a 30000 x 30000 PNG of a few bytes would need gigabytes.
MAX_IMAGE_PIXELS = 89_478_485

# transformers' normalisation constants
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
IDEFICS3_MAX_EDGE = 4096  # transformers' absolute bound on a resized edge


@dataclass(frozen=True)
class ImageProcessing:
    """How one family turns an image into pixel values (``read_image_processing`` builds it
    from ``preprocessor_config.json``). Sizes are (height, width); ``size`` is the shortest
    edge for "clip", the fixed size for "siglip", the longest edge for "idefics3"."""

    kind: str  # "clip" | "siglip" | "idefics3" | "llava_next" (llava_next_images.py)
    size: tuple[int, int]
    resample: int  # PIL's filter number: 1 Lanczos, 2 bilinear, 3 bicubic
    crop_size: tuple[int, int] | None = None  # "clip": the centre crop
    tile: int = 0  # "idefics3": the encoder's input edge (max_image_size)
    split: bool = True  # "idefics3": cut into tiles (do_image_splitting)
    grid_pinpoints: tuple = ()  # "llava_next": the (height, width) resolutions an image is fitted into
    patch_size: int = 0  # "llava_next": the tower's patch edge, from the model's config (vision_processor.py)
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = HALF
    std: tuple[float, ...] = HALF
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True


# image_processor_type -> (kind, default resample, mean, std)
PROCESSOR_TYPES = {
    "CLIPImageProcessor": ("clip", Image.BICUBIC, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
    "LlavaNextImageProcessor": ("llava_next", Image.BICUBIC, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
    "SiglipImageProcessor": ("siglip", Image.BICUBIC, HALF, HALF),
    "Gemma3ImageProcessor": ("siglip", Image.BILINEAR, HALF, HALF),
    "Idefics3ImageProcessor": ("idefics3", Image.LANCZOS, HALF, HALF),
    "SmolVLMImageProcessor": ("idefics3", Image.LANCZOS, HALF, HALF),  # Idefics3's, renamed
}


def read_image_processing(config: dict) -> ImageProcessing:
    """``preprocessor_config.json`` (a dict) -> ``ImageProcessing``; a processor type
    mlx_tfm does not know, or an option it does not implement, is a ``UserError``."""
    name = str(config.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    if name not in PROCESSOR_TYPES:
        raise UserError(f"image processor {name or '(none)'!r} is not supported ({', '.join(PROCESSOR_TYPES)})")
    if config.get("do_pan_and_scan"):
        raise UserError("Gemma 3's pan-and-scan crops are not supported: set do_pan_and_scan to false")
    kind, resample, mean, std = PROCESSOR_TYPES[name]
    size, fields = config.get("size") or {}, {}
    if kind in ("clip", "llava_next"):
        crop = config.get("crop_size") or {}
        fields["size"] = (size["shortest_edge"],) * 2
        fields["crop_size"] = (crop["height"], crop["width"]) if config.get("do_center_crop", True) else None
        if kind == "llava_next":
            fields.update(anyres_fields(config))
    elif kind == "siglip":
        fields["size"] = (size["height"], size["width"])
    else:
        fields["size"] = (size["longest_edge"],) * 2
        fields["tile"] = config["max_image_size"]["longest_edge"]
        fields["split"] = bool(config.get("do_image_splitting", True))
    return ImageProcessing(
        kind=kind, resample=int(config.get("resample", resample)), **fields,
        rescale_factor=float(config.get("rescale_factor", 1 / 255)),
        mean=tuple(config.get("image_mean") or mean), std=tuple(config.get("image_std") or std),
        do_resize=bool(config.get("do_resize", True)), do_rescale=bool(config.get("do_rescale", True)),
        do_normalize=bool(config.get("do_normalize", True)),
    )


def anyres_fields(config: dict) -> dict:
    """LLaVA-NeXT's views: their edge (the crop's height, else the size, as transformers
    picks it) and the resolutions an image is fitted into."""
    pinpoints = tuple(tuple(p) for p in config.get("image_grid_pinpoints") or ())
    if not pinpoints:
        raise UserError("a LLaVA-NeXT image processor without image_grid_pinpoints cannot cut its images")
    edge = (config.get("crop_size") or {}).get("height") or config["size"]["shortest_edge"]
    return {"tile": edge, "grid_pinpoints": pinpoints}


# -- loading ------------------------------------------------------------------------


def load_image(source: str | Path | bytes | Image.Image) -> Image.Image:
    """A path, encoded bytes or a PIL image -> an RGB PIL image, transparency composited
    onto white (as transformers' ``convert_to_rgb``). Refuses, with a one-line
    ``UserError``, a file that is not an image, a truncated one and a decompression bomb."""
    if isinstance(source, Image.Image):
        return to_rgb(source)
    name = "the image bytes" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise UserError(f"no image file at {name}")
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with warnings.catch_warnings():
            # PIL only warns between the limit and twice it: make that a refusal too
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(stream) as image:
                image.load()
                return to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UserError(f"{name} has more than {MAX_IMAGE_PIXELS} pixels: refused as a possible decompression bomb") \
            from None
    except Image.UnidentifiedImageError:
        raise UserError(f"{name} is not an image PIL can read") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise UserError(f"{name} could not be decoded ({str(error).splitlines()[0]}): is it truncated?") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with transparency is composited onto a white background first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


# -- sizes -------------------------------------------------------------------------


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """CLIP: the shorter side becomes ``edge``, the longer keeps the aspect ratio (floored)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def longest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """Idefics3: the longer side becomes ``edge``, the shorter follows and is made even;
    then both are bounded by ``IDEFICS3_MAX_EDGE``."""
    aspect = width / height
    if width >= height:
        width, height = edge, int(edge / aspect)
        height += height % 2
    else:
        height, width = edge, int(edge * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height  # the bound keeps the resized shape's own ratio
    if width >= height and width > IDEFICS3_MAX_EDGE:
        width, height = IDEFICS3_MAX_EDGE, int(IDEFICS3_MAX_EDGE / aspect)
    elif height > width and height > IDEFICS3_MAX_EDGE:
        height, width = IDEFICS3_MAX_EDGE, int(IDEFICS3_MAX_EDGE * aspect)
    return max(height, 1), max(width, 1)


def tiled_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3: both sides up to multiples of ``tile``; the shorter side is first derived
    from the longer one's new length, as transformers does."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


# -- pixels ------------------------------------------------------------------------


def resized(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    return image if image.size == (width, height) else image.resize((width, height), resample=resample)


def center_cropped(image: Image.Image, height: int, width: int) -> Image.Image:
    """The centre ``height x width``; a smaller image is first padded with black around it."""
    if image.height < height or image.width < width:
        padded = Image.new("RGB", (max(width, image.width), max(height, image.height)))
        padded.paste(image, (math.ceil((padded.width - image.width) / 2), math.ceil((padded.height - image.height) / 2)))
        image = padded
    top, left = (image.height - height) // 2, (image.width - width) // 2
    return image.crop((left, top, left + width, top + height))


def normalized(image: Image.Image, processing: ImageProcessing) -> np.ndarray:
    """8-bit RGB -> float32 (3, H, W): rescaled in float64 then float32, as transformers."""
    pixels = np.asarray(image).transpose(2, 0, 1)  # (H, W, 3) -> (3, H, W)
    if processing.do_rescale:
        pixels = (pixels.astype(np.float64) * processing.rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32)
    if processing.do_normalize:
        mean = np.array(processing.mean, dtype=np.float32)[:, None, None]
        std = np.array(processing.std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return pixels


def idefics3_frames(image: Image.Image, processing: ImageProcessing) -> tuple[list[Image.Image], int, int]:
    """Idefics3's views of one image: ``rows x cols`` tiles (row by row) then the global
    view; (the views, rows, cols), rows = cols = 0 when the image is one view."""
    tile, resample = processing.tile, processing.resample
    if processing.do_resize:
        image = resized(image, *longest_edge_size(image.height, image.width, processing.size[0]), resample)
    if not processing.split:
        return [resized(image, tile, tile, resample)], 0, 0
    image = resized(image, *tiled_size(image.height, image.width, tile), resample)
    if image.height <= tile and image.width <= tile:
        return [image], 0, 0
    rows, cols = image.height // tile, image.width // tile
    tiles = [image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
    return [*tiles, resized(image, tile, tile, resample)], rows, cols


def image_frames(image: Image.Image, processing: ImageProcessing) -> tuple[list[Image.Image], int, int]:
    """The views the encoder sees of one image, and Idefics3's rows and cols (else 0, 0)."""
    if processing.kind == "idefics3":
        return idefics3_frames(image, processing)
    if processing.kind == "clip":
        return [clip_view(image, processing)], 0, 0
    if processing.do_resize:
        image = resized(image, *processing.size, processing.resample)
    if processing.crop_size is not None:
        image = center_cropped(image, *processing.crop_size)
    return [image], 0, 0


def clip_view(image: Image.Image, processing: ImageProcessing) -> Image.Image:
    """CLIP's view: the shortest edge resized to ``size``, then the centre crop."""
    if processing.do_resize:
        image = resized(image, *shortest_edge_size(image.height, image.width, processing.size[0]),
                        processing.resample)
    if processing.crop_size is not None:
        image = center_cropped(image, *processing.crop_size)
    return image


def preprocess_images(images: list, processing: ImageProcessing) -> dict:
    """Images (paths, bytes or PIL images) -> the encoder's inputs: ``pixel_values``
    float32 (n_views, 3, H, W), every view of every image in order; ``views`` (views per
    image); ``rows`` and ``cols`` (Idefics3's tile grid per image, else 0)."""
    frames, views, rows, cols = [], [], [], []
    for source in images:
        image_views, image_rows, image_cols = image_frames(load_image(source), processing)
        frames += [normalized(view, processing) for view in image_views]
        views.append(len(image_views))
        rows.append(image_rows)
        cols.append(image_cols)
    if frames and len({f.shape for f in frames}) > 1:
        raise UserError("these images resize to different sizes; pass them one prompt at a time")
    pixel_values = np.stack(frames) if frames else np.zeros((0, 3, 1, 1), np.float32)
    return {"pixel_values": pixel_values, "views": views, "rows": rows, "cols": cols}
