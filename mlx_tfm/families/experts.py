"""Mixture-of-experts families (Mixtral, Qwen MoE, OLMoE, gpt-oss, GLM-4.5): config ->
``ModelArgs`` fields, and per-expert or fused expert tensors -> the stacked layout."""

from __future__ import annotations

import re

import mlx.core as mx

from ..errors import UserError
from .common import Architecture
from .decoders import llama_args, qwen2_args, qwen3_args

# -- mixtures of experts ------------------------------------------------------------------
# On disk (mlx-lm's layout) a layer's experts are stacked per projection,
# ``{block}.switch_mlp.{gate,up,down}_proj.weight`` (experts, out, in); gpt-oss keeps
# ``mlp.experts.*`` and ``mlp.router``, Mixtral ``block_sparse_moe``. Hugging Face stores
# one tensor per expert (``experts.N.gate_proj`` / Mixtral's ``experts.N.w1``), or, written by
# transformers 5 with ``save_original_format=False``, gate and up fused per layer.


def num_experts_of(config: dict) -> int:
    return config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0


def moe_args(config: dict, **fields) -> dict:
    """The expert fields every MoE family shares, plus the family's own."""
    return {
        "num_experts": num_experts_of(config),
        "num_experts_per_tok": config.get("num_experts_per_tok", 0),
        "norm_topk_prob": config.get("norm_topk_prob", False),
        "moe_intermediate_size": config.get("moe_intermediate_size"),
        **fields,
    }


def mixtral_args(config: dict) -> dict:
    # Softmax over all experts, the top k renormalised (transformers' MixtralTopKRouter).
    return {**llama_args(config), **moe_args(config, norm_topk_prob=True)}


def qwen2_moe_args(config: dict) -> dict:
    return {
        **qwen2_args(config),
        "attention_bias": config.get("qkv_bias", True),
        **moe_args(config, shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
                   shared_expert_gate=True, decoder_sparse_step=config.get("decoder_sparse_step", 1),
                   mlp_only_layers=config.get("mlp_only_layers") or ()),
    }


def qwen3_moe_args(config: dict) -> dict:
    return {**qwen3_args(config), **moe_args(config, decoder_sparse_step=config.get("decoder_sparse_step", 1),
                                             mlp_only_layers=config.get("mlp_only_layers") or ())}


def olmoe_args(config: dict) -> dict:
    # q/k norm over the whole projection (as OLMo 2), q/k/v optionally clipped.
    return {**llama_args(config), "qk_norm": True, "qk_norm_scope": "projection", "clip_qkv": config.get("clip_qkv"),
            "attention_out_bias": config.get("attention_bias", False), **moe_args(config)}


def gpt_oss_args(config: dict) -> dict:
    """gpt-oss: biases everywhere, attention sinks, alternating sliding and full layers,
    top-k-then-softmax routing with a router bias, experts with biases and a clamped SwiGLU."""
    n_layers = config["num_hidden_layers"]
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    return {
        **llama_args(config),
        "attention_bias": True,
        "attention_out_bias": True,
        "attention_sinks": True,
        "sliding_window": config.get("sliding_window", 128),
        "layer_types": config.get("layer_types") or alternating,
        **moe_args(config, router_scoring="topk_softmax", router_bias=True, expert_bias=True,
                   swiglu_limit=config.get("swiglu_limit", 7.0), swiglu_alpha=config.get("swiglu_alpha", 1.702)),
    }


def glm4_moe_args(config: dict) -> dict:
    """GLM-4.5: sigmoid routing with a learned choice bias over groups of experts, an
    ungated shared expert, the first ``first_k_dense_replace`` layers dense, partial RoPE."""
    shared = config.get("n_shared_experts") or 0
    return {
        **llama_args(config),
        "attention_out_bias": False,
        "qk_norm": config.get("use_qk_norm", False),
        **moe_args(config, router_scoring="sigmoid", routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
                   n_group=config.get("n_group") or 1, topk_group=config.get("topk_group") or 1,
                   shared_expert_intermediate_size=shared * config["moe_intermediate_size"],
                   first_k_dense_replace=config.get("first_k_dense_replace", 0)),
    }


PER_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(\w+)\.(weight|bias|scales|biases)")
FUSED_EXPERTS = re.compile(r"(.*)\.experts\.(gate_up_proj|down_proj)")


def stack_experts(weights: dict, n_experts: int, projections: dict[str, str]) -> dict:
    """``{block}.experts.{e}.{projection}.{kind}`` for e < n_experts ->
    ``{block}.switch_mlp.{projections[projection]}.{kind}`` stacked (experts first); an
    expert missing from a layer that has the others is named."""
    stacks: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    out = {}
    for name, tensor in weights.items():
        match = PER_EXPERT.fullmatch(name)
        if match is None or match[3] not in projections:
            out[name] = tensor
            continue
        block, expert, projection, kind = match.groups()
        stacks.setdefault((block, projection, kind), {})[int(expert)] = tensor
    for (block, projection, kind), tensors in stacks.items():
        missing = [e for e in range(n_experts) if e not in tensors]
        if missing:
            raise UserError(f"checkpoint is missing expert {missing[0]} of {block} ({n_experts} experts): "
                            f"no {block}.experts.{missing[0]}.{projection}.{kind}")
        extra = sorted(set(tensors) - set(range(n_experts)))
        if extra:
            raise UserError(f"checkpoint has expert {extra[0]} in {block}, but the config says {n_experts} experts")
        stacked = mx.stack([tensors[e] for e in range(n_experts)])  # (experts, out, in)
        out[f"{block}.switch_mlp.{projections[projection]}.{kind}"] = stacked
    return out


def split_fused_experts(weights: dict) -> dict:
    """transformers 5's fused experts, ``{block}.experts.gate_up_proj`` (experts, 2F, D),
    gate rows first, and ``{block}.experts.down_proj`` (experts, D, F) -> the stacked
    ``{block}.switch_mlp.*`` projections."""
    out = {}
    for name, tensor in weights.items():
        match = FUSED_EXPERTS.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        block, fused = match.groups()
        if fused == "down_proj":
            out[f"{block}.switch_mlp.down_proj.weight"] = tensor
            continue
        F = tensor.shape[1] // 2
        out[f"{block}.switch_mlp.gate_proj.weight"] = tensor[:, :F]
        out[f"{block}.switch_mlp.up_proj.weight"] = tensor[:, F:]
    return out


QWEN_EXPERT_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
MIXTRAL_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def qwen_moe_layout(weights: dict, config: dict) -> dict:
    """Qwen2/3-MoE and OLMoE: per-expert or fused Hugging Face experts -> stacked."""
    return split_fused_experts(stack_experts(weights, num_experts_of(config), QWEN_EXPERT_PROJECTIONS))


def glm4_moe_layout(weights: dict, config: dict) -> dict:
    """As Qwen-MoE, less the next-token-prediction layers GLM checkpoints append after the
    last block (``num_nextn_predict_layers``; not part of the language model)."""
    n_layers = config["num_hidden_layers"]
    kept = {name: t for name, t in weights.items() if not name.startswith(f"model.layers.{n_layers}.")}
    return qwen_moe_layout(kept, config)


MIXTRAL_FUSED_BLOCK = re.compile(r"(model\.layers\.\d+)\.mlp\.(gate|switch_mlp)\.(.*)")


def mixtral_layout(weights: dict, config: dict) -> dict:
    """Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3`` (transformers 5's fused form sits
    under ``mlp``) -> ``block_sparse_moe.switch_mlp.*``, as mlx-lm's mixtral names it."""
    stacked = split_fused_experts(stack_experts(weights, num_experts_of(config), MIXTRAL_EXPERT_PROJECTIONS))
    return {MIXTRAL_FUSED_BLOCK.sub(r"\1.block_sparse_moe.\2.\3", name): t for name, t in stacked.items()}


GPT_OSS_EXPERTS = re.compile(r"(.*)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def gpt_oss_expert_rows(tensor: mx.array, suffix: str | None) -> tuple[str, mx.array]:
    """One gpt-oss expert tensor -> (kind, rows (experts, out, ...)). transformers stores
    weights (experts, in, out); OpenAI's MXFP4 blocks are (experts, out, in / 32, 16) bytes,
    MLX's mxfp4 layout once viewed as uint32 (experts, out, in / 8)."""
    if suffix == "_bias":
        return "bias", tensor
    if suffix == "_scales":
        return "scales", tensor
    if suffix == "_blocks":
        return "weight", tensor.view(mx.uint32).flatten(-2)
    return "weight", tensor.swapaxes(-1, -2)


def gpt_oss_layout(weights: dict, config: dict) -> dict:
    """gpt-oss experts (transformers' float tensors or OpenAI's MXFP4 blocks; gate and up
    interleaved, gate first) -> mlx-lm's ``mlp.experts.{gate,up,down}_proj.*``."""
    out = {}
    for name, tensor in weights.items():
        match = GPT_OSS_EXPERTS.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        block, fused, suffix = match.groups()
        kind, rows = gpt_oss_expert_rows(tensor, suffix)
        if fused == "down_proj":
            out[f"{block}.experts.down_proj.{kind}"] = rows
            continue
        out[f"{block}.experts.gate_proj.{kind}"] = mx.contiguous(rows[:, 0::2])
        out[f"{block}.experts.up_proj.{kind}"] = mx.contiguous(rows[:, 1::2])
    return out


MIXTRAL_RENAMES = ((r"(.*)\.block_sparse_moe\.(.*)", r"\1.mlp.\2"),)
GPT_OSS_RENAMES = (
    (r"(.*)\.mlp\.router\.(.*)", r"\1.mlp.gate.\2"),
    (r"(.*)\.mlp\.experts\.(.*)", r"\1.mlp.switch_mlp.\2"),
)
GLM4_MOE_RENAMES = (
    (r"(.*)\.mlp\.gate\.e_score_correction_bias", r"\1.mlp.e_score_correction_bias"),
    (r"(.*)\.mlp\.shared_experts\.(.*)", r"\1.mlp.shared_expert.\2"),
)
# Router layers (on-disk module paths): quantization keeps them at 8 bits, as mlx-lm's
# qwen3_moe and gpt_oss do; a 4-bit router changes which experts run.
ROUTERS = r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.(gate|router|shared_expert_gate)"


# Mixture-of-experts families, by model_type.
MIXTURES: dict[str, Architecture] = {
    "mixtral": Architecture(args=mixtral_args, renames=MIXTRAL_RENAMES, experts=mixtral_layout, routers=ROUTERS),
    "qwen2_moe": Architecture(args=qwen2_moe_args, experts=qwen_moe_layout, routers=ROUTERS),
    "qwen3_moe": Architecture(args=qwen3_moe_args, experts=qwen_moe_layout, routers=ROUTERS),
    "olmoe": Architecture(args=olmoe_args, experts=qwen_moe_layout, routers=ROUTERS),
    "gpt_oss": Architecture(args=gpt_oss_args, renames=GPT_OSS_RENAMES, experts=gpt_oss_layout, routers=ROUTERS),
    "glm4_moe": Architecture(args=glm4_moe_args, renames=GLM4_MOE_RENAMES, experts=glm4_moe_layout, routers=ROUTERS,
                             router_bits=None),
}
