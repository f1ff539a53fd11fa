"""More mixture-of-experts families (ERNIE 4.5 MoE, Granite MoE and its shared form, PhiMoE,
HunYuan MoE, MiniMax-M2, FlexOlmo, Sarvam, dots.llm1, K-EXAONE): config -> ``ModelArgs``
fields, and their expert tensors -> the stacked layout (mlx-lm's, as in ``experts.py``)."""

from __future__ import annotations

import re

from ..errors import UserError
from ..model.config import ModelArgs
from .common import Architecture, rope_settings, split_rows
from .decoders import exaone4_args, granite_args, llama_args, olmo2_args, split_qkv
from .experts import (
    GLM4_MOE_RENAMES,
    glm4_moe_args,
    glm4_moe_layout,
    MIXTRAL_RENAMES,
    QWEN_EXPERT_PROJECTIONS,
    ROUTERS,
    mixtral_layout,
    moe_args,
    qwen_moe_layout,
    stack_experts,
)
from .more_decoders import HUNYUAN_RENAMES, ernie4_5_args, hunyuan_v1_dense_args


def ernie4_5_moe_args(config: dict) -> dict:
    """ERNIE 4.5 MoE: ERNIE 4.5's attention; experts on every ``moe_layer_interval``-th
    layer from ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the last); a softmax
    router whose choice adds a learned bias, its k weights renormalised; ungated shared
    experts beside them."""
    n_layers = config["num_hidden_layers"]
    end = config.get("moe_layer_end_index", -1)
    end = n_layers - 1 if end == -1 else end
    F = config.get("moe_intermediate_size") or config["intermediate_size"]
    return {
        **ernie4_5_args(config),
        **moe_args(
            {"num_experts": config.get("moe_num_experts", 64), "num_experts_per_tok": config.get("moe_k", 6)},
            norm_topk_prob=True,
            router_choice_bias=True,
            moe_intermediate_size=F,
            shared_expert_intermediate_size=F * (config.get("moe_num_shared_experts") or 0),
            decoder_sparse_step=config.get("moe_layer_interval", 1),
            first_k_dense_replace=config.get("moe_layer_start_index", 1),
            mlp_only_layers=tuple(range(end + 1, n_layers)),
        ),
    }


def granitemoe_args(config: dict) -> dict:
    """Granite MoE: Granite's multipliers, experts chosen by their top-k logits, softmax
    over those k (no shared expert)."""
    return {**granite_args(config), **moe_args(config, router_scoring="topk_softmax")}


def phimoe_args(config: dict) -> dict:
    """Phi-3.5-MoE: LayerNorm with biases (its eps under ``rms_norm_eps``), Mixtral's experts,
    the sparsemixer router, optional biases on attention and the head."""
    bias = config.get("attention_bias", False)
    return {
        **llama_args(config),
        "norm_type": "layernorm",
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "attention_bias": bias,
        "attention_out_bias": bias,
        "lm_head_bias": config.get("lm_head_bias", False),
        **moe_args(config, router_scoring="sparsemixer", router_jitter_eps=config.get("router_jitter_noise", 0.01)),
    }


def hunyuan_v1_moe_args(config: dict) -> dict:
    """HunYuan MoE (Hunyuan-A13B): HunYuan dense's attention; on every layer experts as wide
    as the dense MLP, a softmax top-k router renormalised, and an ungated shared MLP."""
    top_k = config.get("moe_topk", 1)
    if isinstance(top_k, list):
        if len(set(top_k)) != 1:
            raise UserError("hunyuan_v1_moe with a different moe_topk per layer is not supported")
        top_k = top_k[0]
    F = config["intermediate_size"]
    return {**hunyuan_v1_dense_args(config),
            **moe_args(config, num_experts_per_tok=top_k, norm_topk_prob=True, moe_intermediate_size=F,
                       shared_expert_intermediate_size=F)}


def minimax_m2_args(config: dict) -> dict:
    """MiniMax-M2: full attention with q/k norm over the whole projection and partial RoPE
    (hub configs say ``rotary_dim``), Mixtral's experts chosen by sigmoid scores plus a
    learned bias, the chosen scores renormalised."""
    rope = rope_settings(config)
    head_dim = config.get("head_dim") or 128
    if config.get("rotary_dim") and not (config.get("rope_parameters") or {}).get("partial_rotary_factor"):
        rope["partial_rotary_factor"] = config["rotary_dim"] / head_dim
    return {
        **llama_args({**config, "head_dim": head_dim}),
        **rope,
        "qk_norm": config.get("use_qk_norm", True),
        "qk_norm_scope": "projection",
        **moe_args(config, router_scoring="sigmoid", norm_topk_prob=True),
    }


def flex_olmo_args(config: dict) -> dict:
    """FlexOlmo: OLMo 2's block (norms after each sublayer, q/k norm over the projection)
    with OLMoE's experts (softmax router, optionally renormalised)."""
    return {**olmo2_args(config), **moe_args(config)}


def sarvam_moe_args(config: dict) -> dict:
    """Sarvam MoE: GLM-4.5 rotating whole heads, its hub configs spelling the expert counts
    and q/k/v bias as ``num_experts``, ``num_shared_experts``, ``use_qkv_bias``."""
    spelled = {
        "n_routed_experts": config.get("n_routed_experts") or config.get("num_experts"),
        "n_shared_experts": config.get("n_shared_experts", config.get("num_shared_experts", 1)),
        "attention_bias": config.get("attention_bias", config.get("use_qkv_bias", False)),
        "use_qk_norm": config.get("use_qk_norm", True),
    }
    args = glm4_moe_args({**config, **spelled, "head_dim": config.get("head_dim") or 64})
    return {**args, "attention_bias": spelled["attention_bias"]}


def deepseek_router_args(config: dict, n_experts: int, n_shared: int) -> dict:
    """DeepSeek-V3's router as dots1 and EXAONE MoE configure it: sigmoid scores, a learned
    choice bias, the best ``topk_group`` of ``n_group`` groups, weights times
    ``routed_scaling_factor``; ungated shared experts of ``n_shared`` times the experts' width."""
    return moe_args(
        {**config, "num_experts": n_experts},
        router_scoring="sigmoid",
        routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
        n_group=config.get("n_group") or 1,
        topk_group=config.get("topk_group") or 1,
        shared_expert_intermediate_size=n_shared * config["moe_intermediate_size"],
    )


def dots1_args(config: dict) -> dict:
    """dots.llm1: Qwen 3's attention (q/k norm per head; sliding layers from
    ``max_window_layers`` on), DeepSeek-V3's router, the first ``first_k_dense_replace``
    layers dense."""
    n_layers, first = config["num_hidden_layers"], config.get("max_window_layers", config["num_hidden_layers"])
    window = config.get("sliding_window")
    default = ["sliding_attention" if window and i >= first else "full_attention" for i in range(n_layers)]
    layer_types = config.get("layer_types") or default
    return {
        **llama_args(config),
        "qk_norm": True,
        "sliding_window": window if "sliding_attention" in layer_types else None,
        "layer_types": layer_types,
        **deepseek_router_args(config, config.get("n_routed_experts") or 0, config.get("n_shared_experts") or 0),
        "first_k_dense_replace": config.get("first_k_dense_replace", 0),
    }


def exaone_moe_args(config: dict) -> dict:
    """K-EXAONE: EXAONE 4's attention (q/k norm per head; with a window only the sliding
    layers rotate) in a pre-norm block, DeepSeek-V3's router, dense layers where
    ``mlp_layer_types`` (else the first ``first_k_dense_replace``) says."""
    n_layers = config["num_hidden_layers"]
    first_dense = config.get("first_k_dense_replace", 1)
    mlp_types = config.get("mlp_layer_types") or ["dense" if i < first_dense else "sparse" for i in range(n_layers)]
    return {
        **exaone4_args(config),
        "norm_placement": "pre",
        **deepseek_router_args(config, config.get("num_experts", 64), config.get("num_shared_experts", 1)),
        "norm_topk_prob": config.get("norm_topk_prob", True),
        "mlp_only_layers": tuple(i for i, t in enumerate(mlp_types) if t == "dense"),
    }


def dots1_layout(weights: dict, config: dict) -> dict:
    """Per-expert experts -> stacked under ``mlp.experts.*``, where mlx-lm's dots1 keeps them."""
    stacked = qwen_moe_layout(weights, config)
    return {DOTS1_STACKED.sub(r"\1.experts.", name): t for name, t in stacked.items()}


DOTS1_STACKED = re.compile(r"(\.mlp)\.switch_mlp\.")


def granitemoeshared_args(config: dict) -> dict:
    """Granite MoE with a shared MLP beside the experts (``shared_intermediate_size``; 0: none)."""
    return {**granitemoe_args(config), "shared_expert_intermediate_size": config.get("shared_intermediate_size", 0)}


def granitemoeshared_rewrite(weights: dict, args: ModelArgs) -> dict:
    # the shared MLP's input_linear holds gate rows, then up rows (GraniteMoeSharedMLP chunks in two)
    S = args.shared_expert_intermediate_size
    return split_rows(weights, "shared_expert.gate_up_proj", {"shared_expert.gate_proj": S, "shared_expert.up_proj": S})


ERNIE_CORRECTION_BIAS = re.compile(r"(.*)\.mlp\.e_score_correction_bias")


def ernie4_5_moe_layout(weights: dict, config: dict) -> dict:
    """Per-expert Hugging Face experts -> stacked (the router's correction bias stays under
    ``moe_statics``, where mlx-lm's ernie4_5_moe expects and drops it)."""
    n_experts = config.get("moe_num_experts", 64)
    return stack_experts(weights, n_experts, QWEN_EXPERT_PROJECTIONS)


def ernie4_5_moe_rewrite(weights: dict, args: ModelArgs) -> dict:
    # moe_statics keeps one bias row per expert group (always one): (1, E) -> (E,)
    return {name: t.reshape(-1) if ERNIE_CORRECTION_BIAS.fullmatch(name) else t for name, t in weights.items()}


GRANITEMOE_FUSED = re.compile(r"(.*)\.block_sparse_moe\.(input_linear|output_linear)\.(weight|scales|biases)")


def granitemoe_layout(weights: dict, config: dict) -> dict:
    """Granite MoE's ``input_linear`` (experts, 2F, D: gate rows, then up) and
    ``output_linear`` (experts, D, F) -> mlx-lm's ``block_sparse_moe.switch_mlp.*``."""
    out = {}
    for name, tensor in weights.items():
        match = GRANITEMOE_FUSED.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        block, fused, kind = match.groups()
        if fused == "output_linear":
            out[f"{block}.block_sparse_moe.switch_mlp.down_proj.{kind}"] = tensor
            continue
        F = tensor.shape[1] // 2
        out[f"{block}.block_sparse_moe.switch_mlp.gate_proj.{kind}"] = tensor[:, :F]
        out[f"{block}.block_sparse_moe.switch_mlp.up_proj.{kind}"] = tensor[:, F:]
    return out


ERNIE4_5_MOE_RENAMES = (
    (r"(.*)\.mlp\.moe_statics\.e_score_correction_bias", r"\1.mlp.e_score_correction_bias"),
    (r"(.*)\.mlp\.shared_experts\.(.*)", r"\1.mlp.shared_expert.\2"),
)
GRANITEMOE_RENAMES = (
    (r"(.*)\.block_sparse_moe\.router\.layer\.(.*)", r"\1.mlp.gate.\2"),
    (r"(.*)\.block_sparse_moe\.(.*)", r"\1.mlp.\2"),
)
HUNYUAN_MOE_RENAMES = (
    *HUNYUAN_RENAMES,
    (r"(.*)\.mlp\.gate\.wg\.(.*)", r"\1.mlp.gate.\2"),
    (r"(.*)\.mlp\.shared_mlp\.(.*)", r"\1.mlp.shared_expert.\2"),
)
# Sarvam's original names (its bailing-style attention), as transformers' conversion maps them.
SARVAM_MOE_RENAMES = (
    (r"model\.word_embeddings\.(.*)", r"model.embed_tokens.\1"),
    (r"(.*)\.attention\.query_key_value\.(.*)", r"\1.self_attn.qkv_proj.\2"),
    (r"(.*)\.attention\.dense\.(.*)", r"\1.self_attn.o_proj.\2"),
    (r"(.*)\.attention\.query_layernorm\.(.*)", r"\1.self_attn.q_norm.\2"),
    (r"(.*)\.attention\.key_layernorm\.(.*)", r"\1.self_attn.k_norm.\2"),
    (r"(.*)\.mlp\.gate\.expert_bias", r"\1.mlp.e_score_correction_bias"),
    *GLM4_MOE_RENAMES,
)
DOTS1_RENAMES = (
    (r"(.*)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)", r"\1.mlp.switch_mlp.\2.\3"),
    *GLM4_MOE_RENAMES,
)
GRANITEMOESHARED_RENAMES = (
    (r"(.*)\.shared_mlp\.input_linear\.(.*)", r"\1.mlp.shared_expert.gate_up_proj.\2"),
    (r"(.*)\.shared_mlp\.output_linear\.(.*)", r"\1.mlp.shared_expert.down_proj.\2"),
    *GRANITEMOE_RENAMES,
)
# Router layers (on-disk module paths), kept at 8 bits when quantizing, as in experts.py.
ERNIE_ROUTERS = r"model\.layers\.\d+\.mlp\.gate"
GRANITEMOE_ROUTERS = r"model\.layers\.\d+\.block_sparse_moe\.router\.layer"


# More mixture-of-experts families, by model_type.
MORE_MIXTURES: dict[str, Architecture] = {
    "ernie4_5_moe": Architecture(args=ernie4_5_moe_args, renames=ERNIE4_5_MOE_RENAMES, experts=ernie4_5_moe_layout,
                                 rewrite=ernie4_5_moe_rewrite, routers=ERNIE_ROUTERS),
    "granitemoe": Architecture(args=granitemoe_args, renames=GRANITEMOE_RENAMES, experts=granitemoe_layout,
                               routers=GRANITEMOE_ROUTERS),
    "flex_olmo": Architecture(args=flex_olmo_args, experts=qwen_moe_layout, routers=ROUTERS),
    "granitemoeshared": Architecture(args=granitemoeshared_args, renames=GRANITEMOESHARED_RENAMES,
                                     experts=granitemoe_layout, rewrite=granitemoeshared_rewrite,
                                     routers=GRANITEMOE_ROUTERS),
    "hunyuan_v1_moe": Architecture(args=hunyuan_v1_moe_args, renames=HUNYUAN_MOE_RENAMES, experts=qwen_moe_layout,
                                   routers=r"model\.layers\.\d+\.mlp\.gate\.wg"),
    "minimax_m2": Architecture(args=minimax_m2_args, renames=MIXTRAL_RENAMES, experts=mixtral_layout, routers=ROUTERS),
    "sarvam_moe": Architecture(args=sarvam_moe_args, renames=SARVAM_MOE_RENAMES, experts=glm4_moe_layout,
                               rewrite=split_qkv, routers=ROUTERS),
    "phimoe": Architecture(args=phimoe_args, renames=MIXTRAL_RENAMES, experts=mixtral_layout, routers=ROUTERS),
    # mlx-lm's dots1 and exaone_moe routers are no linear layers: they stay float
    "dots1": Architecture(args=dots1_args, renames=DOTS1_RENAMES, experts=dots1_layout, routers=ERNIE_ROUTERS,
                          router_bits=None),
    "exaone_moe": Architecture(args=exaone_moe_args, renames=GLM4_MOE_RENAMES, experts=qwen_moe_layout,
                               routers=ERNIE_ROUTERS, router_bits=None),
}
