"""Qwen2-VL and Qwen2.5-VL: Qwen2's language model with M-RoPE, and Qwen's vision tower.

A checkpoint holds both: ``text_config`` (older ones: the text keys at the top level) and
``vision_config``. The table entries build ``VisionLanguageModel`` with Qwen's tower
(``vision`` holds ``qwen_tower``, the ``QwenVisionArgs`` fields); the language model's
attention rotates by (t, h, w) positions per token (``model/mrope.py``).

On disk (what the converter writes, as mlx-lm's qwen2_vl reads it and drops the tower):
``language_model.model.*``, ``language_model.lm_head.*`` and ``visual.*`` with the Conv3d
patch kernel as transformers saves it. The layout reads transformers 5's
``model.language_model.*`` / ``model.visual.*``, the first checkpoints' ``model.*`` /
``visual.*`` and mlx-vlm's ``vision_tower.*`` (its kernel channels-last). Loaded, the tower
is ``vision_tower.*`` with the kernel flattened for the patch matmul.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from ..model.config import ModelArgs
from ..model.qwen3_vision import make_qwen_tower
from ..model.qwen_vision import QwenVisionArgs
from .common import COMMON_DROPS, Architecture, activation
from .decoders import qwen2_args, qwen3_args
from .experts import qwen3_moe_args, split_fused_experts

# Qwen2-VL's published sections of a 128-wide head's 64 frequencies, where a config omits them
DEFAULT_MROPE_SECTION = (16, 24, 24)
QWEN3_MROPE_SECTION = (24, 20, 20)  # Qwen3-VL's, interleaved
QWEN3_5_MROPE_SECTION = (11, 11, 10)  # Qwen3.5's, interleaved, of its partial rotary
# model_type -> its tower (model/qwen_vision.py STYLES)
TOWER_STYLES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
                "qwen3_5": "qwen3_vl", "qwen3_5_moe": "qwen3_vl"}  # Qwen3.5's: Qwen3-VL's without DeepStack
QWEN_IMAGE_TOKEN_ID = 151655  # <|image_pad|> in Qwen2's vocabulary, where a config omits it
VISION_PREFIX = re.compile(r"(?:model\.)?(?:visual|vision_tower)\.(.*)")


def text_config_of(config: dict) -> dict:
    """The language model's keys: ``text_config``, else the top level; the head is tied by
    the outer config where it says (transformers 5 writes it there)."""
    text = dict(config.get("text_config") or config)
    if "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def mrope_section_of(text: dict, model_type: str = "qwen2_vl") -> list[int]:
    """(t, h, w) frequency runs from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    for key in ("rope_parameters", "rope_scaling"):
        if (text.get(key) or {}).get("mrope_section"):
            return list(text[key]["mrope_section"])
    if model_type.startswith("qwen3_5"):
        return list(QWEN3_5_MROPE_SECTION)
    return list(QWEN3_MROPE_SECTION if TOWER_STYLES.get(model_type) == "qwen3_vl" else DEFAULT_MROPE_SECTION)


def mrope_args(config: dict, text_args, interleaved: bool = False) -> dict:
    """The language model's fields by ``text_args`` (its text family's), rotated by M-RoPE
    with the frequencies split by mrope_section (run after run, or ``interleaved``)."""
    text = text_config_of(config)
    params = text.get("rope_parameters") or {}
    rope_theta = params.get("rope_theta") or text.get("rope_theta", 1000000.0)
    partial = params.get("partial_rotary_factor") or text.get("partial_rotary_factor", 1.0)  # Qwen3.5 turns a part
    plain = {**text, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta,
                                         "partial_rotary_factor": partial}, "rope_scaling": None}
    rope = {"rope_type": "mrope", "mrope_section": mrope_section_of(text, config["model_type"])}
    return {**text_args(plain), "rope_scaling": {**rope, "mrope_interleaved": True} if interleaved else rope,
            "model_type": config["model_type"], "vision": qwen_vision_fields(config)}


def qwen_vl_args(config: dict) -> dict:
    """Qwen2's attention (q/k/v biases) with M-RoPE."""
    return mrope_args(config, qwen2_args)


def qwen3_vl_args(config: dict) -> dict:
    """Qwen3's attention (q/k norms, no biases) with interleaved M-RoPE."""
    return mrope_args(config, qwen3_args, interleaved=True)


def qwen3_vl_moe_args(config: dict) -> dict:
    """Qwen3-MoE's language model with interleaved M-RoPE; its router always renormalises
    the chosen experts' weights (the config has no norm_topk_prob)."""
    return {**mrope_args(config, qwen3_moe_args, interleaved=True), "norm_topk_prob": True}


def qwen3_vl_moe_experts(weights: dict, config: dict) -> dict:
    """Fused experts -> the stacked ``switch_mlp.*`` projections of the on-disk layout (as
    mlx-lm reads them). The hub's checkpoints hold ``experts.gate_up_proj`` (E, D, 2F) and
    ``experts.down_proj`` (E, F, D); transformers 5 transposes them on loading and saves
    them so, (E, 2F, D) and (E, D, F), which ``split_fused_experts`` reads."""
    hidden = text_config_of(config)["hidden_size"]
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".mlp.experts.down_proj")]:
        gate_up_name = name.removesuffix("down_proj") + "gate_up_proj"
        if hub_orientation(weights[name].shape, weights[gate_up_name].shape, hidden):
            out[name] = weights[name].swapaxes(1, 2)  # (E, F, D) -> (E, D, F)
            out[gate_up_name] = weights[gate_up_name].swapaxes(1, 2)  # (E, D, 2F) -> (E, 2F, D)
    return split_fused_experts(out)


def hub_orientation(down: tuple, gate_up: tuple, hidden: int) -> bool:
    """Whether a layer's fused experts are the hub's (down (E, F, D)) rather than
    transformers 5's (E, D, F); where F = D leaves down square, gate_up (E, D, 2F) tells."""
    if down[1] != down[2]:
        return down[2] == hidden
    return gate_up[1] == hidden


def qwen_vision_fields(config: dict) -> dict | None:
    """``VisionArgs`` fields of the image side: Qwen's tower and the image token; None for
    a config without ``vision_config`` (a text-only export: the language model alone)."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    tower = dataclasses.asdict(vision_args(config))
    lists = {key: list(tower[key]) for key in ("fullatt_block_indexes", "deepstack_visual_indexes")}
    return {"qwen_tower": {**tower, **lists},
            "image_token_id": config.get("image_token_id", QWEN_IMAGE_TOKEN_ID)}


def qwen_vl_layout(weights: dict) -> dict:
    """transformers' names (``model.language_model.*``, ``model.visual.*``, or the first
    checkpoints' ``model.*``, ``visual.*``; ``lm_head.*``) and mlx-vlm's ``vision_tower.*``
    -> the on-disk layout (``language_model.model.*``, ``language_model.lm_head.*``,
    ``visual.*``); a folder in that layout passes unchanged."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.visual."):
            name = name.removeprefix("model.")
        elif name.startswith("vision_tower."):  # mlx-vlm's
            name = "visual." + name.removeprefix("vision_tower.")
            tensor = channels_first_kernel(name, tensor)
        elif name.startswith(("model.", "lm_head.")):
            name = "language_model." + name
        out[name] = tensor
    return out


def channels_first_kernel(name: str, tensor: mx.array) -> mx.array:
    """mlx-vlm's channels-last patch kernel (D, T, P, P, C) as transformers' (D, C, T, P, P);
    a channels-first kernel ends in two equal sides (P, P), a channels-last one in (P, C)."""
    if name == "visual.patch_embed.proj.weight" and tensor.ndim == 5 and tensor.shape[-1] != tensor.shape[-2]:
        return mx.moveaxis(tensor, -1, 1)
    return tensor


def qwen_vl_rewrite(weights: dict, args: ModelArgs) -> dict:
    """Our names: the Conv3d kernel (D, C, T, P, P) flattened to the patch matmul's
    (D, C * T * P * P); a tied head's copy dropped; the tower dropped where the config
    builds no image side."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("vision_tower.") and args.vision is None:
            continue
        if name == "vision_tower.patch_embed.proj.weight" and tensor.ndim == 5:
            tensor = tensor.reshape(tensor.shape[0], -1)  # (D, C, T, P, P) -> (D, C * T * P * P)
        out[name] = tensor
    if args.tie_word_embeddings:
        out.pop("language_model.lm_head.weight", None)
    return out


QWEN_VL_RENAMES = ((r"visual\.(.*)", r"vision_tower.\1"),)
# On-disk paths -q keeps in float unless --quantize-vision: the tower with its merger
QWEN_VL_TOWER_PATHS = r"visual\..*"


def qwen_vl_family(args=qwen_vl_args) -> Architecture:
    return Architecture(args=args, renames=QWEN_VL_RENAMES, drops=COMMON_DROPS, layout=qwen_vl_layout,
                        rewrite=qwen_vl_rewrite, unquantized=QWEN_VL_TOWER_PATHS)


QWEN_VL: dict[str, Architecture] = {
    "qwen2_vl": qwen_vl_family(), "qwen2_5_vl": qwen_vl_family(), "qwen3_vl": qwen_vl_family(qwen3_vl_args),
    "qwen3_vl_moe": dataclasses.replace(qwen_vl_family(qwen3_vl_moe_args), experts=qwen3_vl_moe_experts,
                                        routers=r"language_model\.model\.layers\.\d+\.mlp\.gate"),
}


def qwen_vl_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's qwen2_vl reads ``text_config`` as Qwen2's config: the head's tying (which
    transformers 5 writes at the top level) and ``rope_theta`` (inside its rope_parameters)."""
    if not isinstance(config.get("text_config"), dict):
        return {}  # the first checkpoints' flat config, which mlx-lm reads as it is
    text = text_config_of(config)
    keys = {"tie_word_embeddings": text.get("tie_word_embeddings", False), "rope_theta": qwen_vl_args(config)["rope_theta"]}
    if config.get("model_type") == "qwen3_vl_moe":  # mlx-lm's qwen3_moe requires what Qwen3-VL-MoE implies
        moe = qwen3_vl_moe_args(config)
        keys |= {"num_experts": moe["num_experts"], "norm_topk_prob": True}
    return {"text_config": {**config["text_config"], **keys}}


QWEN_VL_MLX_LM_KEYS = dict.fromkeys(QWEN_VL, qwen_vl_mlx_lm_keys)


# -- the vision tower --------------------------------------------------------------------


def vision_args(config: dict) -> QwenVisionArgs:
    """The tower's configuration from a checkpoint's config.json (its ``vision_config``)."""
    if config.get("model_type") not in TOWER_STYLES:
        raise UserError(f"model_type {config.get('model_type')!r} has no Qwen vision tower ({', '.join(TOWER_STYLES)})")
    if not isinstance(config.get("vision_config"), dict):
        raise UserError(f"the {config['model_type']} config has no vision_config")
    args = QwenVisionArgs.from_dict(config["vision_config"], TOWER_STYLES[config["model_type"]])
    if args.style == "qwen2_vl":  # its MLP takes quick_gelu only (the tower checks)
        return args
    return dataclasses.replace(args, hidden_act=activation(args.hidden_act))  # Hugging Face's name -> ours


def vision_weights(weights: dict, args: QwenVisionArgs) -> dict:
    """A checkpoint's tower tensors under the tower's own names: the prefix dropped, the
    Conv3d kernel (D, C, T, P, P) flattened to the patch matmul's (D, C * T * P * P)
    (mlx-vlm's channels-last (D, T, P, P, C) moved to channels first before that)."""
    out = {}
    for name, tensor in weights.items():
        match = VISION_PREFIX.fullmatch(name)
        if match is None:
            continue
        name = match.group(1)
        if name == "patch_embed.proj.weight" and tensor.ndim == 5:
            if tensor.shape[-1] == args.in_channels and tensor.shape[1] != args.in_channels:
                tensor = mx.moveaxis(tensor, -1, 1)  # (D, T, P, P, C) -> (D, C, T, P, P)
            tensor = tensor.reshape(tensor.shape[0], -1)
        out[name] = tensor
    return out


def vision_tower_from_checkpoint(config: dict, weights: dict) -> nn.Module:
    """The tower of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint, its weights loaded strictly."""
    args = vision_args(config)
    tower = make_qwen_tower(args)
    tensors = vision_weights(weights, args)
    expected = {name: value.shape for name, value in tree_flatten(tower.parameters())}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise UserError(f"vision tower weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    wrong = [name for name in expected if tuple(tensors[name].shape) != tuple(expected[name])]
    if wrong:
        raise UserError(f"vision tower weight {wrong[0]} is {tuple(tensors[wrong[0]].shape)}, "
                        f"expected {tuple(expected[wrong[0]])}")
    tower.update(tree_unflatten(list(tensors.items())))
    return tower

