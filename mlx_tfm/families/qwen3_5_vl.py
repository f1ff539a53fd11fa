"""Qwen3.5 and Qwen3.5-MoE with their images: the hybrid language model of ``hybrids.py``
(Gated DeltaNet layers, a gated full-attention layer every few) turned by interleaved
M-RoPE over its partial rotary, and Qwen3-VL's tower without DeepStack.

On disk (what the converter writes): mlx-lm's ``language_model.*`` (norms as (1 + weight),
the convolution (C, K, 1): ``hybrids.mlx_lm_norms_and_conv``) beside the tower as
transformers names it, ``model.visual.*`` with its Conv3d patch kernel; mlx-lm's qwen3_5
drops ``model.visual.*`` when it loads, so our folders stay readable there. The layout also
reads mlx-vlm's folders, whose tower is ``vision_tower.*`` with the kernel channels-last.
Loaded, the tower is ``vision_tower.*`` with the kernel flattened for the patch matmul; -q
keeps it in float unless asked. A folder without the tower (mlx-lm's conversions) loads the
language model alone (``weights/build.py``).
"""

from __future__ import annotations

from ..model.config import ModelArgs
from .common import Architecture
from .decoders import saved_language_model_name
from .hybrids import (
    HYBRID_DROPS,
    HYBRID_ROUTERS,
    hybrid_args,
    hybrid_experts,
    mlx_lm_norms_and_conv,
    qwen3_5_moe_text_args,
    split_fused_projections,
)
from .qwen_vl import channels_first_kernel, mrope_args, qwen_vl_rewrite

# The tower's on-disk paths, which -q keeps in float unless --quantize-vision
QWEN3_5_TOWER = r"model\.visual\..*"


def with_images(text_args):
    """config.json -> the hybrid language model's fields with interleaved M-RoPE and the tower."""

    def args(config: dict) -> dict:
        return mrope_args(config, text_args, interleaved=True)

    return args


def qwen3_5_layout(weights: dict) -> dict:
    """transformers' names (``model.language_model.*``, ``lm_head.*``, ``model.visual.*``)
    and mlx-vlm's (``language_model.*``, ``vision_tower.*`` with its channels-last kernel)
    -> the on-disk layout; a folder in that layout passes unchanged."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("vision_tower."):  # mlx-vlm's
            tower_name = name.removeprefix("vision_tower.")
            tensor = channels_first_kernel("visual." + tower_name, tensor)
            name = "model.visual." + tower_name
        out[saved_language_model_name(name)] = tensor
    return mlx_lm_norms_and_conv(out)


def qwen3_5_rewrite(weights: dict, args: ModelArgs) -> dict:
    """The fused DeltaNet projections split, then the tower's patch kernel as a matmul."""
    return qwen_vl_rewrite(split_fused_projections(weights, args), args)


def qwen3_5_image_family(text_args, experts=None) -> Architecture:
    return Architecture(args=with_images(text_args), renames=((r"model\.visual\.(.*)", r"vision_tower.\1"),),
                        drops=HYBRID_DROPS, layout=qwen3_5_layout, rewrite=qwen3_5_rewrite, experts=experts,
                        routers=HYBRID_ROUTERS if experts else None, unquantized=QWEN3_5_TOWER)


QWEN3_5_VL: dict[str, Architecture] = {
    "qwen3_5": qwen3_5_image_family(hybrid_args),
    "qwen3_5_moe": qwen3_5_image_family(qwen3_5_moe_text_args, hybrid_experts),
}
