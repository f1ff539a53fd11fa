"""Kimi Linear (``kimi_linear``): Kimi Delta Attention (``model/kimi_delta.py``) on most
layers, multi-head latent attention without positions on the others, DeepSeek-V3's
sigmoid-routed experts with shared experts, the first layer(s) dense.

The config comes in two spellings: Moonshot's (a ``linear_attn_config`` with 1-based
``kda_layers`` / ``full_attn_layers``, ``first_k_dense_replace``) and transformers' (flat
``linear_num_heads``, ``linear_head_dim``, ``layer_types``, ``mlp_layer_types``); both name
the experts as transformers' attribute map does (``num_experts``, ``num_experts_per_token``,
``num_expert_group``, ``num_shared_experts``, ``moe_renormalize``).

The checkpoint keeps every feed-forward under ``block_sparse_moe`` (experts as
``experts.N.w1/w2/w3``) and each KDA convolution as PyTorch lays it out, (C, 1, K). The
on-disk layout is what mlx-lm's kimi_linear reads without renaming: the feed-forwards
under ``mlp`` (experts stacked in ``switch_mlp``, the router's bias as
``mlp.e_score_correction_bias``), each convolution as ``q_conv.conv`` laid out as MLX
lays it out, (C, K, 1) (mlx-lm transposes every ``q_conv1d`` it reads, so the name tells
it the layout), and Moonshot's ``linear_attn_config`` beside transformers' flat keys in
config.json; ``kv_b_proj`` split per head (``embed_q``, ``unembed_out``), which mlx-lm
reads as it is (a whole one, from folders written before, is split when loaded).
"""

from __future__ import annotations

import re

import mlx.core as mx

from ..errors import UserError
from .common import Architecture
from .decoders import llama_args
from .experts import moe_args, stack_experts
from .latent import latent_fields, per_head_kv_b, split_kv_b_when_loaded

KDA_CONV = re.compile(r".*\.self_attn\.[qkv]_conv1d\.weight")
KIMI_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def kimi_layer_types(config: dict) -> list[str]:
    """Per layer "kimi_delta_attention" or "full_attention" (MLA)."""
    n_layers = config["num_hidden_layers"]
    linear = config.get("linear_attn_config") or {}
    if config.get("layer_types"):
        kinds = list(config["layer_types"])
    elif "kda_layers" in linear:
        kda = set(linear["kda_layers"])  # 1-based, as Moonshot numbers them
        kinds = ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n_layers)]
    else:  # transformers' default: every 4th layer from layer 4 on is MLA
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown:
        raise UserError(f"kimi_linear layer type {unknown[0]!r} is not supported (linear_attention, full_attention)")
    return ["kimi_delta_attention" if kind == "linear_attention" else kind for kind in kinds]


def dense_layers(config: dict) -> tuple[int, ...]:
    """The layers whose feed-forward is one dense MLP."""
    kinds = config.get("mlp_layer_types")
    if kinds:
        return tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    return tuple(range(config.get("first_k_dense_replace", 1)))


def kimi_linear_args(config: dict) -> dict:
    linear = config.get("linear_attn_config") or {}
    heads = linear.get("num_heads") or config.get("linear_num_heads", 32)
    head_dim = linear.get("head_dim") or config.get("linear_head_dim", 128)
    shared = config.get("num_shared_experts", config.get("n_shared_experts")) or 0
    experts = {**config, "num_experts_per_tok": config.get("num_experts_per_token", config.get("num_experts_per_tok"))}
    return {
        **llama_args(config),
        **latent_fields(config),
        "position_embedding": "none",  # the MLA layers rotate nothing; KDA needs no positions
        "layer_types": kimi_layer_types(config),
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": linear.get("short_conv_kernel_size") or config.get("linear_conv_kernel_dim", 4),
        "max_position_embeddings": config.get("model_max_length", config.get("max_position_embeddings", 2048)),
        **moe_args(experts, router_scoring="sigmoid", routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
                   n_group=config.get("num_expert_group", config.get("n_group")) or 1,
                   topk_group=config.get("topk_group") or 1,
                   norm_topk_prob=config.get("moe_renormalize", config.get("norm_topk_prob", True)),
                   shared_expert_intermediate_size=shared * config["moe_intermediate_size"],
                   mlp_only_layers=dense_layers(config), first_k_dense_replace=0),  # the dense ones are listed
    }


def kimi_layout(weights: dict) -> dict:
    """The KDA convolutions (C, 1, K) -> (C, K, 1); ones laid out so already pass."""
    return {name: mx.moveaxis(t, 2, 1) if KDA_CONV.fullmatch(name) and t.shape[-1] != 1 else t
            for name, t in weights.items()}


# The checkpoint's names -> the on-disk ones, mlx-lm's (applied once the experts are stacked).
KIMI_ON_DISK = (
    (re.compile(r"(.*)\.block_sparse_moe\.gate\.e_score_correction_bias"), r"\1.mlp.e_score_correction_bias"),
    (re.compile(r"(.*)\.block_sparse_moe\.(.*)"), r"\1.mlp.\2"),
    (re.compile(r"(.*)\.self_attn\.([qkv])_conv1d\.weight"), r"\1.self_attn.\2_conv.conv.weight"),
)


def on_disk_name(name: str) -> str:
    for pattern, replacement in KIMI_ON_DISK:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    return name


def kimi_experts(weights: dict, config: dict) -> dict:
    """``block_sparse_moe.experts.N.w1/w2/w3`` -> stacked ``mlp.switch_mlp.*``, the rest
    under their on-disk names (``KIMI_ON_DISK``), ``kv_b_proj`` per head (as
    deepseek_v3's); next-token-prediction layers (``model.mtp``) dropped."""
    kept = {name: t for name, t in weights.items() if not name.startswith("model.mtp.")}
    stacked = stack_experts(kept, config.get("num_experts") or config.get("num_local_experts"), KIMI_EXPERT_PROJECTIONS)
    renamed = {on_disk_name(name): t for name, t in stacked.items()}
    return per_head_kv_b(renamed, config["num_attention_heads"], config["qk_nope_head_dim"], config["kv_lora_rank"])


def kimi_mlx_lm_keys(config: dict) -> dict:
    """What mlx-lm's kimi_linear reads that transformers' config says in other keys:
    Moonshot's ``linear_attn_config`` (1-based layer numbers), ``first_k_dense_replace``
    when the dense layers are the first ones (mlx-lm has no other placement), and a
    ``rope_theta`` it requires but never uses (no layer rotates)."""
    linear = config.get("linear_attn_config") or {}
    kinds = kimi_layer_types(config)
    keys = {"linear_attn_config": {
        **linear,
        "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "kimi_delta_attention"],
        "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
        "num_heads": linear.get("num_heads") or config.get("linear_num_heads", 32),
        "head_dim": linear.get("head_dim") or config.get("linear_head_dim", 128),
        "short_conv_kernel_size": linear.get("short_conv_kernel_size") or config.get("linear_conv_kernel_dim", 4),
    }, "rope_theta": config.get("rope_theta", 10000.0)}
    dense = dense_layers(config)
    if dense == tuple(range(len(dense))):
        keys["first_k_dense_replace"] = len(dense)
    return keys


KIMI_RENAMES = (
    (r"(.*)\.block_sparse_moe\.gate\.e_score_correction_bias", r"\1.mlp.e_score_correction_bias"),  # older folders
    (r"(.*)\.(block_sparse_moe|mlp)\.shared_experts\.(.*)", r"\1.mlp.shared_expert.\3"),
    (r"(.*)\.block_sparse_moe\.(.*)", r"\1.mlp.\2"),
    (r"(.*)\.self_attn\.([qkv])_conv\.conv\.weight", r"\1.self_attn.\2_conv1d.weight"),
)
KIMI_ROUTERS = r"model\.layers\.\d+\.mlp\.gate"

KIMI: dict[str, Architecture] = {
    "kimi_linear": Architecture(args=kimi_linear_args, renames=KIMI_RENAMES, layout=kimi_layout, experts=kimi_experts,
                                rewrite=split_kv_b_when_loaded, routers=KIMI_ROUTERS, router_bits=None),
}
