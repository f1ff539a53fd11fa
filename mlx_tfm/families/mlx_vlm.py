"""mlx-vlm's image-text folders (``mlx_vlm.convert``) read as the families of vision.py.

What mlx-vlm writes differently from transformers: Idefics3 and SmolVLM's language model
flattened to ``language_model.{embed_tokens,layers,norm,lm_head}.*`` (transformers:
``model.text_model.*``, ``lm_head.*``), and every tower's patch convolution in MLX's
channels-last layout (out, p, p, C) instead of PyTorch's (out, C, p, p). The tower
(``vision_model.*``, ``vision_tower.vision_model.*``) and the projector (``connector.*``,
``multi_modal_projector.*``) already match the vision renames.
"""

from __future__ import annotations

from ..model.config import ModelArgs

MLX_VLM_RENAMES = (
    (r"language_model\.(embed_tokens|layers|norm)\.(.*)", r"language_model.model.\1.\2"),
)

PATCH_WEIGHT = "vision_tower.embeddings.patch_embedding.weight"


def channels_first_patches(weights: dict, args: ModelArgs) -> dict:
    """The patch convolution's weight as (out, C, p, p), from mlx-vlm's (out, p, p, C)."""
    weight = weights.get(PATCH_WEIGHT)
    vision = args.vision or {}
    channels, patch = vision.get("num_channels", 3), vision.get("patch_size")
    if weight is None or weight.ndim != 4 or patch == channels:  # p == C: the layouts cannot be told apart
        return weights
    if tuple(weight.shape[1:]) == (patch, patch, channels):
        weights = {**weights, PATCH_WEIGHT: weight.transpose(0, 3, 1, 2)}
    return weights


def idefics3_mlx_vlm_keys(config: dict) -> dict:
    """mlx-vlm's idefics3, smolvlm and llava_next read the language model's ``rope_theta``
    (their default 1e6), not transformers 5's ``rope_parameters``: restated in ``text_config``."""
    text = config.get("text_config") or {}
    theta = (text.get("rope_parameters") or {}).get("rope_theta", text.get("rope_theta"))
    return {} if theta is None else {"text_config": {**text, "rope_theta": theta}}


def gemma3_mlx_vlm_keys(config: dict) -> dict:
    """mlx-vlm's gemma3 scales the image features by the top-level ``hidden_size`` (its
    default 2048), which transformers keeps in ``text_config`` only."""
    hidden = (config.get("text_config") or {}).get("hidden_size")
    return {} if hidden is None or "hidden_size" in config else {"hidden_size": hidden}


# Config keys mlx-vlm reads that transformers 5 writes differently, by model_type (the
# converter writes them beside mlx-lm's: families/mlx_lm.py; gemma3's there joins them).
MLX_VLM_CONFIG_KEYS = {"idefics3": idefics3_mlx_vlm_keys, "smolvlm": idefics3_mlx_vlm_keys,
                       "llava_next": idefics3_mlx_vlm_keys}
