"""LFM2-VL (``lfm2_vl``): the LFM2 language model (convolutions.py) with SigLIP2's NaFlex
tower and the pixel-unshuffle projector (model/lfm2_vl_vision.py) under ``vision``
(``VisionArgs`` with tower_kind "siglip2_naflex": ``tower`` the SigLIP encoder's
``ModelArgs`` fields without a position table of its own, ``tower_fields`` the patch
embedding's and the projector's).

On disk as transformers 4 and mlx-lm's lfm2-vl keep it (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.*``, ``multi_modal_projector.*``, LFM2's
convolution weights in MLX's layout); transformers 5's in-memory names are renamed there.
"""

from __future__ import annotations

import math

from .common import COMMON_DROPS, Architecture, activation
from .convolutions import LFM2_RENAMES, conv_weight_layout, lfm2_args
from .vision import (
    TOWER,
    VISION_PATHS,
    VISION_RENAMES,
    saved_layout,
    tower_args,
    unused_tower_tensors,
)

# transformers' Siglip2VisionConfig defaults for the keys a hub config leaves out
SIGLIP2_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     num_channels=3, num_patches=256, patch_size=16, hidden_act="gelu_pytorch_tanh",
                     layer_norm_eps=1e-6)


def lfm2_vl_args(config: dict) -> dict:
    """LFM2's fields (``text_config``, the head tied by the top-level key) plus ``vision``."""
    vision = {**SIGLIP2_TOWER, **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}}
    side = math.isqrt(vision["num_patches"])
    encoder = tower_args({**vision, "image_size": side * vision["patch_size"]}, SIGLIP2_TOWER)
    text = {"model_type": "lfm2", **(config.get("text_config") or {})}
    return {**lfm2_args(text), "model_type": config["model_type"],
            "tie_word_embeddings": config.get("tie_word_embeddings", True), "vision": {
                "tower_kind": "siglip2_naflex", "tower": {**encoder["tower"], "position_embedding": "none"},
                "patch_size": vision["patch_size"], "num_channels": vision["num_channels"],
                "image_token_id": config.get("image_token_id", 396),
                "tower_fields": {
                    "num_patches": vision["num_patches"], "patch_size": vision["patch_size"],
                    "num_channels": vision["num_channels"], "downsample_factor": config.get("downsample_factor", 2),
                    "projector_hidden_size": config.get("projector_hidden_size", 2560),
                    "projector_act": activation(config.get("projector_hidden_act", "gelu")),
                    "projector_bias": config.get("projector_bias", True),
                    "projector_layernorm": config.get("projector_use_layernorm", True)}}}


def lfm2_vl_layout(weights: dict) -> dict:
    return conv_weight_layout(saved_layout(weights))


# The tower's names first (LFM2's "(.*).self_attn.out_proj" would catch SigLIP's too), its
# position table kept where NaFlexEmbeddings holds it; then the language model's as LFM2's
LFM2_VL_RENAMES = (
    (TOWER + r"embeddings\.position_embedding\.(.*)", r"vision_tower.embeddings.position_embedding.\1"),
    *VISION_RENAMES[:-2],
    (r"language_model\.model\.embedding_norm\.(.*)", r"language_model.model.norm.\1"),
    *LFM2_RENAMES[1:],
    *VISION_RENAMES[-2:],
)

LFM2_VL_FAMILIES: dict[str, Architecture] = {
    "lfm2_vl": Architecture(args=lfm2_vl_args, renames=LFM2_VL_RENAMES, drops=COMMON_DROPS,
                            rewrite=unused_tower_tensors, layout=lfm2_vl_layout, unquantized=VISION_PATHS),
}
