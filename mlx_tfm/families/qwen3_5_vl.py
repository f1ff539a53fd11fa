"""Qwen3.5 and Qwen3.5-MoE with their images: the hybrid language model of ``hybrids.py``
(Gated DeltaNet layers, a gated full-attention layer every few) turned by interleaved
M-RoPE over its partial rotary, and Qwen3-VL's tower without DeepStack.

``QWEN3_5_VL`` holds the entries, not yet in ``ARCHITECTURES``: there ``hybrids.py``'s
entries load the language model alone (their tests expect the tower dropped). Merged, the
tower stays on disk as transformers names it (``model.visual.*``, which mlx-lm's qwen3_5
drops), beside mlx-lm's ``language_model.*``; -q keeps it in float unless asked.
"""

from __future__ import annotations

from ..model.config import ModelArgs
from .common import Architecture
from .hybrids import (
    HYBRID_DROPS,
    HYBRID_ROUTERS,
    hybrid_args,
    hybrid_experts,
    image_text_layout,
    qwen3_5_moe_text_args,
    split_fused_projections,
)
from .qwen_vl import mrope_args, qwen_vl_rewrite

QWEN3_5_TOWER = r"model\.visual\..*"


def with_images(text_args):
    """config.json -> the hybrid language model's fields with interleaved M-RoPE and the tower."""

    def args(config: dict) -> dict:
        return mrope_args(config, text_args, interleaved=True)

    return args


def qwen3_5_rewrite(weights: dict, args: ModelArgs) -> dict:
    """The fused DeltaNet projections split, then the tower's patch kernel as a matmul."""
    return qwen_vl_rewrite(split_fused_projections(weights, args), args)


def qwen3_5_image_family(text_args, experts=None) -> Architecture:
    return Architecture(args=with_images(text_args), renames=((r"model\.visual\.(.*)", r"vision_tower.\1"),),
                        drops=HYBRID_DROPS, layout=image_text_layout, rewrite=qwen3_5_rewrite, experts=experts,
                        routers=HYBRID_ROUTERS if experts else None, unquantized=QWEN3_5_TOWER)


QWEN3_5_VL: dict[str, Architecture] = {
    "qwen3_5": qwen3_5_image_family(hybrid_args),
    "qwen3_5_moe": qwen3_5_image_family(qwen3_5_moe_text_args, hybrid_experts),
}
