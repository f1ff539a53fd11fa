"""The one quantization policy: what a config's ``quantization`` says, which tensors are
quantized (and at how many bits, for the mixed recipes), and quantizing, dequantizing and
building quantized layers. GPTQ, AWQ, bitsandbytes and FP8 checkpoints are refused by
name: MLX's affine groups cannot read them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError

# -- the quantization policy -------------------------------------------------------------

# Quantization schemes of other runtimes, which MLX's affine layout cannot read.
FOREIGN_QUANTIZATION = {"gptq": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes", "fp8": "FP8",
                        "compressed-tensors": "compressed-tensors", "hqq": "HQQ", "eetq": "EETQ",
                        "aqlm": "AQLM", "exl2": "ExLlamaV2", "quanto": "Quanto", "torchao": "torchao"}
# OpenAI's gpt-oss checkpoints: experts in MXFP4 blocks, which MLX's "mxfp4" mode reads as they are.
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
# mlx_lm.convert --quant-predicate recipes: (low bits, high bits).
QUANT_RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}
# Routers stay at 8 bits whatever the rest gets (mlx-lm's qwen3_moe and gpt_oss predicates).
ROUTER_QUANTIZATION = {"group_size": 64, "bits": 8, "mode": "affine"}


def quantization_of(config: dict, source: Path | str) -> dict | None:
    """MLX quantization settings of a config (``{"group_size", "bits", "mode"}`` plus any
    per-layer entries mlx-lm writes: module path -> its own settings), None for a float
    model; OpenAI's MXFP4 is MLX's mxfp4 mode; any other scheme (GPTQ, AWQ,
    bitsandbytes...) is refused by name."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if not quantization:
        return None
    if "bits" in quantization and "group_size" in quantization and "quant_method" not in quantization:
        return {"mode": "affine", **quantization}
    method = str(quantization.get("quant_method") or quantization.get("mode") or "unknown")
    if method == "mxfp4":
        return dict(MXFP4)
    name = FOREIGN_QUANTIZATION.get(method.lower(), method)
    raise UserError(
        f"{source} is quantized with {name}, which mlx-tfm cannot read; use a float checkpoint "
        "(or an MLX-quantized one) and quantize it with mlx-tfm convert -q"
    )


def layer_quantization(quantization: dict, path: str) -> dict:
    """The settings module ``path`` (on-disk name) was quantized with: its own entry in the
    config (mlx-lm writes one per layer for mixed bits) or the defaults."""
    own = quantization.get(path)
    settings = own if isinstance(own, dict) else quantization
    return {"group_size": settings["group_size"], "bits": settings["bits"], "mode": settings.get("mode", "affine")}


def packed_quantization(module: nn.Module, weight: mx.array, scales: mx.array) -> dict:
    """The settings a checkpoint's packed ``weight`` and ``scales`` were made with, read off
    their shapes against the float module's (as mlx-lm infers them): each layer may have
    its own bits, group size and mode."""
    in_dims = module.weight.shape[-1]
    group_size, bits = in_dims // scales.shape[-1], weight.shape[-1] * 32 // in_dims
    if scales.dtype != mx.uint8:  # only affine keeps its scales in a float type
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    modes = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}
    if (bits, group_size) not in modes:
        raise UserError(f"cannot tell how a layer was quantized: {bits} bits, group size {group_size}, uint8 scales")
    return {"group_size": group_size, "bits": bits, "mode": modes[bits, group_size]}


def quantizable(name: str, tensor: mx.array, group_size: int) -> bool:
    """Linear and embedding matrices, and stacked experts' (experts, out, in) matrices,
    whose rows split into whole groups (as mlx-lm)."""
    return (
        name.endswith(".weight")
        and tensor.ndim in (2, 3)
        and mx.issubdtype(tensor.dtype, mx.floating)
        and tensor.shape[-1] % group_size == 0
    )


def layer_index(path: str) -> int:
    """The block a module path is in (its first number), 0 outside the blocks (as mlx-lm)."""
    return next((int(part) for part in path.split(".") if part.isdigit()), 0)


def recipe_settings(recipe: str, n_layers: int, group_size: int) -> Callable[[str], dict]:
    """mlx_lm.convert's mixed-bit recipe (after llama.cpp's Q4_K_M) as a function of the
    module path: v_proj and down_proj (experts' included) of the first and last eighth of
    the blocks and of every third block between them, and the LM head, get the high bits;
    the rest the low bits. Paths are tested by substring, as mlx-lm does (so phi3's fused
    qkv_proj counts as a v_proj)."""
    low, high = QUANT_RECIPES[recipe]

    def settings(path: str) -> dict:
        index = layer_index(path)
        more_bits = index < n_layers // 8 or index >= 7 * n_layers // 8 or (index - n_layers // 8) % 3 == 2
        values = any(key in path for key in ("v_proj", "v_a_proj", "v_b_proj"))
        high_bits = (more_bits and (values or "down_proj" in path)) or "lm_head" in path
        return {"group_size": group_size, "bits": high if high_bits else low, "mode": "affine"}

    return settings


def quantization_plan(weights: dict, group_size: int, bits: int, recipe: str | None = None, n_layers: int = 0,
                      routers: str | None = None, router_bits: int | None = 8,
                      keep_float: str | None = None) -> Callable[[str], dict | None]:
    """Module path -> the settings it is quantized with, or None to keep it in float: routers
    (``routers``, a regex of on-disk paths) at ``router_bits`` (None: float), paths matching
    ``keep_float`` in float, the rest by ``recipe`` or at ``bits``."""
    if recipe is not None and recipe not in QUANT_RECIPES:
        raise UserError(f"unknown quantization recipe {recipe!r}; choose one of {', '.join(QUANT_RECIPES)}")
    if recipe is not None and not any("down_proj" in name for name in weights):
        raise UserError(f"the {recipe} recipe needs down_proj layers, which this model does not have")
    by_recipe = recipe_settings(recipe, n_layers, group_size) if recipe else None
    default = {"group_size": group_size, "bits": bits, "mode": "affine"}
    router = re.compile(routers) if routers else None
    router_settings = {**ROUTER_QUANTIZATION, "bits": router_bits} if router_bits else None

    def plan(path: str) -> dict | None:
        if keep_float is not None and re.fullmatch(keep_float, path):
            return None
        if router is not None and router.fullmatch(path):
            return router_settings
        return by_recipe(path) if by_recipe else default

    return plan


def quantize_weights(weights: dict, group_size: int, bits: int, plan: Callable[[str], dict | None] | None = None
                     ) -> tuple[dict, dict]:
    """Quantize every quantizable matrix with the settings ``plan(module path)`` gives
    (default: ``group_size``/``bits`` affine). Returns the weights and the per-layer settings
    that differ from the defaults, keyed by module path, for config.json (as mlx-lm writes)."""
    default = {"group_size": group_size, "bits": bits, "mode": "affine"}
    plan = plan or (lambda path: default)
    out, per_layer = {}, {}
    for name, tensor in weights.items():
        base = name.removesuffix(".weight")
        settings = plan(base) if name.endswith(".weight") else None
        if settings is None or not quantizable(name, tensor, settings["group_size"]):
            out[name] = tensor
            continue
        packed = mx.quantize(tensor, settings["group_size"], settings["bits"], mode=settings["mode"])
        out[name], out[f"{base}.scales"] = packed[0], packed[1]
        if len(packed) == 3:  # affine: the offsets
            out[f"{base}.biases"] = packed[2]
        if settings != default:
            per_layer[base] = dict(settings)
    return out, per_layer


def dequantize_weights(weights: dict, quantization: dict, dtype: mx.Dtype | None = None) -> dict:
    """Every ``X.weight`` with ``X.scales`` (and, affine, ``X.biases``) back to a float matrix
    of ``dtype`` (default: the scales' dtype; float16 for the uint8 scales of the float
    modes), each with its layer's settings (``layer_quantization``). Computed in float32, so
    a float32 result is exact."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.scales" in weights:
            scales, biases = weights[f"{base}.scales"], weights.get(f"{base}.biases")
            settings = layer_quantization(quantization, base)
            float_scales = scales if scales.dtype == mx.uint8 else scales.astype(mx.float32)
            tensor = mx.dequantize(
                tensor, float_scales, None if biases is None else biases.astype(mx.float32),
                settings["group_size"], settings["bits"], mode=settings["mode"],
            ).astype(dtype or (mx.float16 if scales.dtype == mx.uint8 else scales.dtype))
        out[name] = tensor
    return out


def quantize_modules(model: nn.Module, quantization: dict, weights: dict) -> None:
    """Swap in quantized layers (linear, embedding, stacked experts) wherever the checkpoint
    carries quantized tensors, each with the settings its tensors were packed with."""

    def settings(path: str, module: nn.Module) -> dict | bool:
        if f"{path}.scales" not in weights:
            return False
        return packed_quantization(module, weights[f"{path}.weight"], weights[f"{path}.scales"])

    nn.quantize(model, class_predicate=settings)
