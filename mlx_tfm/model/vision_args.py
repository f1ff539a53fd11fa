"""``VisionArgs``: what a vision-language model adds to its language model's ``ModelArgs``
(there, the one field ``vision`` holds these as a dict).

The tower itself is the one encoder: ``tower`` holds its ``ModelArgs`` fields (kind
"encoder", no token embeddings, learned positions, CLIP's pre-norm as ``embedding_norm``,
the post-norm as ``final_norm``). The rest says how pixels become its input (the patch
embedding) and how its outputs reach the language model (the projector, the image token,
Gemma 3's attention among an image's tokens, LLaVA-NeXT's packing of an image's views).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config import ModelArgs


@dataclass(frozen=True)
class VisionArgs:
    tower: dict = field(default_factory=dict)  # the tower's ModelArgs fields
    # the patch embedding
    image_size: int = 224  # the tower's input edge in pixels
    patch_size: int = 16
    num_channels: int = 3
    class_token: bool = False  # CLIP: a learned class embedding before the patches
    patch_bias: bool = True  # the patch convolution's bias (CLIP's has none)
    # the projector (model/projectors.py)
    projector: str = "mlp"  # "mlp" (LLaVA) | "pixel_shuffle" (Idefics3, SmolVLM) | "average_pool" (Gemma 3)
    projector_act: str = "gelu"  # "mlp": linear_1 -> this -> linear_2
    projector_bias: bool = True
    vision_feature_select: str = "full"  # "mlp": "default" drops the class token, "full" keeps it
    projector_scale: int = 2  # "pixel_shuffle": each s x s patches become one token
    tokens_per_image: int = 0  # "average_pool": tokens after pooling (a square number)
    # LLaVA-NeXT (model/anyres.py): each image's views packed into one grid, rows ended by image_newline
    image_grid_pinpoints: tuple | None = None  # the (height, width) resolutions an image is fitted into
    # the language model's side
    image_token_id: int = -1  # the token whose embeddings the image features replace
    image_attention: str = "causal"  # "bidirectional" (Gemma 3): one image's tokens see each other
    # -- Qwen's own tower (model/qwen_vision.py: its merger is the projector) --
    qwen_tower: dict | None = None  # QwenVisionArgs fields; None: the ViT of ``tower``
    # -- towers other than the ViT above (Pixtral: model/pixtral_vision.py) --
    tower_kind: str = "vit"  # which model class builds the tower and projector (model/encoders.py)
    tower_fields: dict = field(default_factory=dict)  # that tower's own arguments (e.g. PixtralArgs)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "VisionArgs":
        """Build from a dict, ignoring unknown keys (as ``ModelArgs.from_dict``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in names and v is not None})

    def tower_args(self) -> ModelArgs:
        return ModelArgs.from_dict(self.tower)

    @property
    def grid_side(self) -> int:
        """Patches along each side of the tower's input."""
        return self.image_size // self.patch_size
