"""Families whose layers mix positions with short convolutions (LFM2, LFM2-MoE): config ->
``ModelArgs`` fields, and their checkpoint names onto ours.

LFM2 interleaves "conv" layers (``mlx_tfm/model/short_conv.py``) with attention layers
whose q and k are RMS-normed per head; its blocks are pre-norm (``operator_norm``,
``ffn_norm``), its feed-forward a SwiGLU named ``w1`` / ``w3`` / ``w2``, and its final norm
``embedding_norm``. LFM2-MoE replaces the feed-forward of the layers from
``num_dense_layers`` up with experts behind a sigmoid router whose ``expert_bias`` only
steers the choice (as GLM-4.5's correction bias does).

On disk (mlx-lm's layout) the names stay Hugging Face's, but the depthwise convolution's
weight is stored (D, K, 1), as MLX's grouped Conv1d holds it, and LFM2-MoE's experts are
stacked into ``feed_forward.switch_mlp.*`` with its dense layers' ``w1`` / ``w3`` / ``w2``
named ``gate_proj`` / ``up_proj`` / ``down_proj`` (what mlx-lm's lfm2_moe renames them to).
"""

from __future__ import annotations

import re

from ..errors import UserError
from .common import Architecture, rope_settings
from .experts import MIXTRAL_EXPERT_PROJECTIONS, num_experts_of, split_fused_experts, stack_experts


def lfm2_layer_types(config: dict) -> list[str]:
    """``layer_types``, or (older and mlx-lm configs) attention at ``full_attn_idxs``."""
    n_layers = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    attention_at = config.get("full_attn_idxs")
    attention_at = set(range(n_layers) if attention_at is None else attention_at)
    return ["full_attention" if i in attention_at else "conv" for i in range(n_layers)]


def lfm2_ff_dim(config: dict) -> int:
    """The feed-forward width as ``Lfm2MLP`` derives it: two thirds of the configured
    width, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``."""
    width = config.get("block_ff_dim") or config["intermediate_size"]
    if not config.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    multiple = config.get("block_multiple_of", 256)
    width = int(multiplier * width)
    return multiple * ((width + multiple - 1) // multiple)


def conv_family_args(config: dict) -> dict:
    """What LFM2 and LFM2-MoE share: attention with per-head q/k norms, conv layers."""
    return {
        "model_type": config["model_type"],
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads"),
        "max_position_embeddings": config.get("max_position_embeddings", 128000),
        **rope_settings({"rope_theta": 1000000.0, **config}),
        "norm_type": "rmsnorm",
        "norm_eps": config.get("norm_eps", 1e-5),
        "hidden_act": "silu",
        "qk_norm": True,
        "layer_types": lfm2_layer_types(config),
        "conv_L_cache": config.get("conv_L_cache", 3),
        "conv_bias": config.get("conv_bias", False),
        "tie_word_embeddings": config.get("tie_word_embeddings", config.get("tie_embedding", True)),
    }


def lfm2_args(config: dict) -> dict:
    return {**conv_family_args(config), "intermediate_size": lfm2_ff_dim(config)}


def lfm2_moe_args(config: dict) -> dict:
    if not config.get("use_expert_bias", True):
        raise UserError("lfm2_moe with use_expert_bias false is not supported")
    return {
        **conv_family_args(config),
        "intermediate_size": config["intermediate_size"],
        "num_experts": num_experts_of(config),
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config.get("moe_intermediate_size"),
        "router_scoring": "sigmoid",
        "norm_topk_prob": config.get("norm_topk_prob", True),
        "routed_scaling_factor": config.get("routed_scaling_factor", 1.0),
        "first_k_dense_replace": config.get("num_dense_layers", 2),
    }


CONV_WEIGHT = re.compile(r".*\.conv\.conv\.weight")


def conv_weight_layout(weights: dict) -> dict:
    """Hugging Face's depthwise Conv1d weight (D, 1, K) -> MLX's (D, K, 1); on-disk ones
    (already (D, K, 1)) pass through."""
    out = {}
    for name, tensor in weights.items():
        if CONV_WEIGHT.fullmatch(name) and tensor.ndim == 3 and tensor.shape[-1] > tensor.shape[1]:
            tensor = tensor.swapaxes(1, 2)
        out[name] = tensor
    return out


DENSE_FFN = re.compile(r"(.*\.feed_forward)\.(w1|w2|w3)\.(.*)")
DENSE_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def lfm2_moe_layout(weights: dict, config: dict) -> dict:
    """Per-expert (``experts.N.w1``...) or fused experts stacked into ``switch_mlp``, and the
    dense layers' ``w1`` / ``w3`` / ``w2`` named as mlx-lm's lfm2_moe names them."""
    stacked = split_fused_experts(stack_experts(weights, num_experts_of(config), MIXTRAL_EXPERT_PROJECTIONS))
    out = {}
    for name, tensor in stacked.items():
        match = DENSE_FFN.fullmatch(name)
        out[f"{match[1]}.{DENSE_NAMES[match[2]]}.{match[3]}" if match else name] = tensor
    return out


# On-disk names -> ours (applied in order, the first match wins).
LFM2_RENAMES = (
    (r"model\.embedding_norm\.(.*)", r"model.norm.\1"),
    (r"(.*)\.operator_norm\.(.*)", r"\1.input_layernorm.\2"),
    (r"(.*)\.ffn_norm\.(.*)", r"\1.post_attention_layernorm.\2"),
    (r"(.*)\.self_attn\.out_proj\.(.*)", r"\1.self_attn.o_proj.\2"),
    (r"(.*)\.self_attn\.q_layernorm\.(.*)", r"\1.self_attn.q_norm.\2"),
    (r"(.*)\.self_attn\.k_layernorm\.(.*)", r"\1.self_attn.k_norm.\2"),
    (r"(.*)\.feed_forward\.w1\.(.*)", r"\1.mlp.gate_proj.\2"),
    (r"(.*)\.feed_forward\.w3\.(.*)", r"\1.mlp.up_proj.\2"),
    (r"(.*)\.feed_forward\.w2\.(.*)", r"\1.mlp.down_proj.\2"),
    (r"(.*)\.feed_forward\.expert_bias", r"\1.mlp.e_score_correction_bias"),
    (r"(.*)\.feed_forward\.(.*)", r"\1.mlp.\2"),
)
# LFM2-MoE's routers (on-disk module paths), kept at 8 bits as mlx-lm's lfm2_moe keeps them.
LFM2_MOE_ROUTERS = r"model\.layers\.\d+\.feed_forward\.gate"


CONVOLUTIONS: dict[str, Architecture] = {
    "lfm2": Architecture(args=lfm2_args, renames=LFM2_RENAMES, layout=conv_weight_layout),
    "lfm2_moe": Architecture(args=lfm2_moe_args, renames=LFM2_RENAMES, layout=conv_weight_layout,
                             experts=lfm2_moe_layout, routers=LFM2_MOE_ROUTERS),
}


def lfm2_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's lfm2 requires ``block_dim`` and ``block_ff_dim``, which transformers 5 no
    longer writes (they equal hidden_size and intermediate_size)."""
    return {"block_dim": config.get("block_dim") or config["hidden_size"],
            "block_ff_dim": config.get("block_ff_dim") or config["intermediate_size"]}
