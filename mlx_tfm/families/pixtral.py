"""Pixtral's tower (model/pixtral_vision.py) in two families: Mistral 3 (Mistral Small
3.1, Ministral 3; its language model as ``more_decoders.mistral3_args`` reads it, Mistral 3's
projector) and Pixtral 12B (a ``llava`` checkpoint whose vision_config is "pixtral": LLaVA's
MLP projector, one token per patch). Both put ``VisionArgs`` with tower_kind "pixtral" under
``vision``, the tower's fields in ``tower_fields``. A ``llava`` checkpoint with a CLIP tower
reads as vision.py says.

On disk as transformers 4 saves it and mlx-lm's mistral3 reads it (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.*``, ``multi_modal_projector.*``): those are
our names too; transformers 5's in-memory names are renamed by ``vision.saved_layout``.
"""

from __future__ import annotations

import re

from ..errors import UserError
from ..model.config import ModelArgs
from .common import COMMON_DROPS, Architecture, activation
from .more_decoders import mistral3_args
from .vision import (
    VISION_PATHS,
    VISION_RENAMES,
    llava_args,
    llava_feature_layers,
    saved_layout,
    text_args,
    unused_tower_tensors,
)

# transformers' Mistral 3 defaults for the vision_config keys a hub config leaves out
PIXTRAL_TOWER = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                     patch_size=14, num_channels=3, hidden_act="gelu")


def pixtral_tower_fields(vision: dict, layers: int) -> dict:
    """``PixtralArgs``' tower fields from a ``vision_config``; the head width is always
    hidden_size / heads (transformers derives it so, whatever the config says)."""
    v = {**PIXTRAL_TOWER, **{k: val for k, val in vision.items() if val is not None}}
    theta = (v.get("rope_parameters") or {}).get("rope_theta") or v.get("rope_theta", 10000.0)
    return {"hidden_size": v["hidden_size"], "intermediate_size": v["intermediate_size"], "num_hidden_layers": layers,
            "num_attention_heads": v["num_attention_heads"], "head_dim": v["hidden_size"] // v["num_attention_heads"],
            "rope_theta": theta, "hidden_act": activation(v["hidden_act"]), "patch_size": v["patch_size"],
            "num_channels": v["num_channels"]}


def mistral3_vision_args(config: dict) -> dict:
    """The language model's fields plus ``vision``: Pixtral's tower up to
    ``vision_feature_layer`` and the projector (RMSNorm at the text model's eps, the patch
    merger, linear_1 -> act -> linear_2)."""
    vision, text = config.get("vision_config") or {}, config.get("text_config") or {}
    if not isinstance(config.get("vision_feature_layer", -1), int):
        raise UserError("Mistral 3 with several vision_feature_layer entries is not supported")
    layers = llava_feature_layers({"vision_feature_layer": config.get("vision_feature_layer", -1)},
                                  vision.get("num_hidden_layers", PIXTRAL_TOWER["num_hidden_layers"]))
    fields = {**pixtral_tower_fields(vision, layers), "spatial_merge_size": config.get("spatial_merge_size", 2),
              "projector_norm_eps": text.get("rms_norm_eps", 1e-5),
              "projector_act": activation(config.get("projector_hidden_act", "gelu")),
              "projector_bias": config.get("multimodal_projector_bias", False)}
    return {**mistral3_args(config), "vision": {
        "tower_kind": "pixtral", "tower_fields": fields, "patch_size": fields["patch_size"],
        "num_channels": fields["num_channels"],
        "image_token_id": config.get("image_token_index", config.get("image_token_id", 10)),
    }}


def llava_pixtral_args(config: dict) -> dict:
    """Pixtral 12B: the language model (``text_config``), Pixtral's tower and LLaVA's MLP."""
    vision = config.get("vision_config") or {}
    if config.get("vision_feature_select_strategy", "default") != "full":
        raise UserError("LLaVA with a Pixtral tower reads vision_feature_select_strategy 'full' only")
    layers = llava_feature_layers(config, vision.get("num_hidden_layers", PIXTRAL_TOWER["num_hidden_layers"]))
    fields = {**pixtral_tower_fields(vision, layers), "projector": "llava", "spatial_merge_size": 1,
              "projector_act": activation(config.get("projector_hidden_act", "gelu")),
              "projector_bias": config.get("multimodal_projector_bias", True)}
    return {**text_args(config, "llama"), "model_type": config["model_type"], "vision": {
        "tower_kind": "pixtral", "tower_fields": fields, "patch_size": fields["patch_size"],
        "num_channels": fields["num_channels"],
        "image_token_id": config.get("image_token_index", config.get("image_token_id", 10)),
    }}


def has_pixtral_tower(config: dict) -> bool:
    return (config.get("vision_config") or {}).get("model_type") == "pixtral"


def llava_any_tower_args(config: dict) -> dict:
    return llava_pixtral_args(config) if has_pixtral_tower(config) else llava_args(config)


def unused_llava_tensors(weights: dict, args: ModelArgs) -> dict:
    pixtral = args.vision.get("tower_kind") == "pixtral"
    return (unused_pixtral_tensors if pixtral else unused_tower_tensors)(weights, args)


def unused_pixtral_tensors(weights: dict, args: ModelArgs) -> dict:
    """Without the tower's layers after the feature layer, and a tied head's copy."""
    layers = args.vision["tower_fields"]["num_hidden_layers"]
    pattern = re.compile(r"vision_tower\.transformer\.layers\.(\d+)\..*")

    def used(name: str) -> bool:
        match = pattern.fullmatch(name)
        return match is None or int(match.group(1)) < layers

    kept = {name: tensor for name, tensor in weights.items() if used(name)}
    if args.tie_word_embeddings:
        kept.pop("language_model.lm_head.weight", None)
    return kept


PIXTRAL_FAMILIES: dict[str, Architecture] = {
    # replaces vision.py's llava: the same for a CLIP tower, Pixtral 12B's for a Pixtral one
    # (its tensor names pass VISION_RENAMES unchanged but for the language model's)
    "llava": Architecture(args=llava_any_tower_args, renames=VISION_RENAMES, drops=COMMON_DROPS,
                          rewrite=unused_llava_tensors, layout=saved_layout, unquantized=VISION_PATHS),
    # replaces more_decoders' text-only reading of mistral3 (families/__init__.py puts it after)
    "mistral3": Architecture(args=mistral3_vision_args, drops=COMMON_DROPS, rewrite=unused_pixtral_tensors,
                             layout=saved_layout, unquantized=VISION_PATHS),
}
