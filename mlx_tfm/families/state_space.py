"""State-space families: pure Mamba-2 and the hybrids that mix Mamba-2 layers with attention
(Granite 4, Nemotron-H, Falcon-H1): config -> ``ModelArgs`` fields, and their tensor names.

The Mamba-2 mixer is ``model/mamba.py`` (layer type "mamba"); these entries only say where
each family puts it. Hugging Face stores the mixers' ``conv1d.weight`` as PyTorch's
(conv_dim, 1, K); the on-disk layout (mlx-lm's) keeps MLX's (conv_dim, K, 1).
"""

from __future__ import annotations

import re

import mlx.core as mx

from ..errors import UserError
from ..model.config import ModelArgs
from .common import COMMON_DROPS, Architecture, activation, rope_settings, split_rows
from .decoders import granite_args, llama_args
from .experts import moe_args, stack_experts


def mamba_fields(config: dict, heads: int, head_dim: int, inner: int, **fields) -> dict:
    """The ``mamba_*`` fields every family shares (``fields`` adds or overrides), checked:
    the heads must tile the inner width the family's config implies."""
    if heads * head_dim != inner:
        raise UserError(f"the Mamba heads ({heads} x {head_dim}) do not tile the inner width {inner}")
    return {
        "mamba_num_heads": heads,
        "mamba_head_dim": head_dim,
        "mamba_time_step_limit": time_step_limit(config),
        **fields,
    }


def json_float(value) -> float:
    """A number from config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def time_step_limit(config: dict) -> tuple[float, float]:
    low, high = config.get("time_step_limit") or (0.0, float("inf"))
    return json_float(low), json_float(high)


def conv_to_mlx_layout(weights: dict) -> dict:
    """PyTorch's depthwise ``*.conv1d.weight`` (C, 1, K) -> MLX's (C, K, 1); MLX's passes."""
    return {name: (t.swapaxes(1, 2) if name.endswith("conv1d.weight") and t.shape[-1] != 1 else t)
            for name, t in weights.items()}


def mamba2_args(config: dict) -> dict:
    """Pure Mamba-2: every block a pre-norm Mamba-2 mixer with its residual, no MLP."""
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UserError(f"mamba2 with hidden_act {config['hidden_act']!r} is not supported (silu only)")
    n_layers, D = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_heads"]
    return {
        "model_type": config["model_type"],
        "vocab_size": config["vocab_size"],
        "hidden_size": D,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 1,  # no attention layers
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "position_embedding": "none",
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "layer_types": ["mamba"] * n_layers,
        "block_sublayers": ["mixer"] * n_layers,
        **mamba_fields(config, heads, config["head_dim"], int(config.get("expand", 2) * D),
                       mamba_state_size=config["state_size"], mamba_n_groups=config.get("n_groups", 8),
                       mamba_conv_kernel=config.get("conv_kernel", 4), mamba_chunk_size=config.get("chunk_size", 256),
                       mamba_proj_bias=config.get("use_bias", False), mamba_out_proj_bias=config.get("use_bias", False),
                       mamba_conv_bias=config.get("use_conv_bias", True),
                       mamba_norm_eps=config.get("layer_norm_epsilon", 1e-5)),
    }


def mamba_args(config: dict) -> dict:
    """Mamba-1: every block a pre-norm Mamba-1 mixer (selective scan, layer type "mamba1")."""
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UserError(f"mamba with hidden_act {config['hidden_act']!r} is not supported (silu only)")
    if config.get("use_bcdt_rms") or config.get("model_type") == "falcon_mamba":
        raise UserError("mamba with RMS-normed B, C and dt (falcon_mamba) is not supported")
    n_layers, D = config["num_hidden_layers"], config["hidden_size"]
    rank = config.get("time_step_rank", "auto")
    return {
        "model_type": "mamba",
        "vocab_size": config["vocab_size"],
        "hidden_size": D,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 1,  # no attention layers
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "position_embedding": "none",
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
        "layer_types": ["mamba1"] * n_layers,
        "block_sublayers": ["mixer"] * n_layers,
        "mamba_inner_size": config.get("intermediate_size") or int(config.get("expand", 2) * D),
        "mamba_dt_rank": -(-D // 16) if rank == "auto" else int(rank),
        "mamba_state_size": config.get("state_size", 16),
        "mamba_conv_kernel": config.get("conv_kernel", 4),
        "mamba_proj_bias": config.get("use_bias", False),
        "mamba_out_proj_bias": config.get("use_bias", False),
        "mamba_conv_bias": config.get("use_conv_bias", True),
    }


# Granite 4's layer kinds: transformers 5 writes linear_attention / full_attention, mlx-lm
# (and the folders we write for it) mamba / attention.
GRANITE_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "full_attention",
                 "attention": "full_attention"}


def granite_hybrid_layers(config: dict) -> list[str]:
    kinds = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * config["num_hidden_layers"]
    unknown = sorted({k for k in kinds if k not in GRANITE_KINDS})
    if unknown:
        raise UserError(f"granitemoehybrid layers of kind {unknown[0]!r} are not supported (mamba, attention)")
    return [GRANITE_KINDS[k] for k in kinds]


def granite_hybrid_args(config: dict) -> dict:
    """Granite 4: Granite's multipliers, Mamba-2 and attention layers, each block's FFN a
    mixture of experts (top-k logits softmaxed) plus a shared MLP every position takes, or
    that MLP alone when the config has no experts; RoPE only when position_embedding_type says."""
    D, heads = config["hidden_size"], config["mamba_n_heads"]
    inner = int(config.get("mamba_expand", 2) * D)
    head_dim = config.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else head_dim
    shared = config.get("shared_intermediate_size", 1024)
    n_experts = config.get("num_local_experts", 0) or 0
    return {
        **granite_args(config),
        "position_embedding": "rope" if config.get("position_embedding_type") == "rope" else "none",
        "layer_types": granite_hybrid_layers(config),
        **moe_args(config, router_scoring="topk_softmax", moe_intermediate_size=config["intermediate_size"],
                   shared_expert_intermediate_size=shared if n_experts else 0),
        "intermediate_size": config["intermediate_size"] if n_experts else shared,
        **mamba_fields(config, heads, head_dim, inner, mamba_state_size=config.get("mamba_d_state", 256),
                       mamba_n_groups=config.get("mamba_n_groups", 1), mamba_conv_kernel=config.get("mamba_d_conv", 4),
                       mamba_chunk_size=config.get("mamba_chunk_size", 256),
                       mamba_proj_bias=config.get("mamba_proj_bias", False),
                       mamba_out_proj_bias=config.get("mamba_proj_bias", False),
                       mamba_conv_bias=config.get("mamba_conv_bias", True),
                       mamba_norm_eps=config.get("rms_norm_eps", 1e-6)),
    }


GRANITE_EXPERTS = re.compile(r"(.*)\.block_sparse_moe\.(input_linear|output_linear)\.weight")
GRANITE_SHARED = re.compile(r"(.*)\.shared_mlp\.(input_linear|output_linear)\.(weight|scales|biases)")


def granite_hybrid_layout(weights: dict, config: dict) -> dict:
    """Granite 4's Hugging Face tensors -> mlx-lm's: each layer's experts (E, 2F, D) gate rows
    first, split into ``block_sparse_moe.switch_mlp.{gate,up,down}_proj``; without experts
    the shared MLP is the dense ``mlp.{gate,up,down}_proj``. On-disk names pass through."""
    dense = not config.get("num_local_experts")
    out = {}
    for name, tensor in conv_to_mlx_layout(weights).items():
        experts, shared = GRANITE_EXPERTS.fullmatch(name), GRANITE_SHARED.fullmatch(name)
        if experts is not None:
            block, part = experts.groups()
            if part == "output_linear":
                out[f"{block}.block_sparse_moe.switch_mlp.down_proj.weight"] = tensor
                continue
            F = tensor.shape[1] // 2
            out[f"{block}.block_sparse_moe.switch_mlp.gate_proj.weight"] = tensor[:, :F]
            out[f"{block}.block_sparse_moe.switch_mlp.up_proj.weight"] = tensor[:, F:]
        elif shared is not None and dense:
            block, part, kind = shared.groups()
            if part == "output_linear":
                out[f"{block}.mlp.down_proj.{kind}"] = tensor
                continue
            F = tensor.shape[0] // 2
            out[f"{block}.mlp.gate_proj.{kind}"], out[f"{block}.mlp.up_proj.{kind}"] = tensor[:F], tensor[F:]
        else:
            out[name] = tensor
    return out


def split_shared_mlp(weights: dict, args: ModelArgs) -> dict:
    """The shared MLP's fused ``input_linear`` holds gate rows then up rows."""
    F = args.shared_expert_intermediate_size
    return split_rows(weights, "input_linear", {"gate_proj": F, "up_proj": F})


GRANITE_HYBRID_RENAMES = (
    (r"(.*)\.block_sparse_moe\.router\.layer\.(.*)", r"\1.mlp.gate.\2"),
    (r"(.*)\.block_sparse_moe\.switch_mlp\.(.*)", r"\1.mlp.switch_mlp.\2"),
    (r"(.*)\.shared_mlp\.input_linear\.(.*)", r"\1.mlp.shared_expert.input_linear.\2"),
    (r"(.*)\.shared_mlp\.output_linear\.(.*)", r"\1.mlp.shared_expert.down_proj.\2"),
)


def granite_hybrid_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's granitemoehybrid reads the layer kinds as mamba / attention, and without
    experts sizes its dense MLP (our shared MLP) by intermediate_size."""
    keys = {"layer_types": ["mamba" if k == "mamba" else "attention" for k in granite_hybrid_layers(config)],
            "time_step_limit": list(time_step_limit(config))}
    if not config.get("num_local_experts"):
        keys["intermediate_size"] = config.get("shared_intermediate_size", 1024)
    return keys


def falcon_h1_inner(config: dict) -> tuple[int, int, int]:
    """(heads, head_dim, inner width) of Falcon-H1's Mamba-2 mixers."""
    heads = config["mamba_n_heads"]
    inner = config.get("mamba_d_ssm") or int(config.get("mamba_expand", 2) * config["hidden_size"])
    head_dim = config.get("mamba_d_head", "auto")
    return heads, (inner // heads if head_dim == "auto" else head_dim), inner


def falcon_h1_args(config: dict) -> dict:
    """Falcon-H1: each layer's attention and a Mamba-2 mixer read one normed input side by
    side. Its muP multipliers are folded into the weights (``falcon_h1_layout``, as mlx-lm
    stores them); what stays is the head's lm_head / embedding ratio where the head is tied."""
    heads, head_dim, inner = falcon_h1_inner(config)
    tied = config.get("tie_word_embeddings", False)
    ratio = config.get("lm_head_multiplier", 1.0) / config.get("embedding_multiplier", 1.0)
    return {
        **llama_args(config),
        "norm_eps": config.get("rms_norm_eps", 1e-5),
        "attention_out_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
        "tie_word_embeddings": tied,
        "logit_scale": ratio if tied else 1.0,
        "layer_types": ["full_attention"] * config["num_hidden_layers"],
        "mamba_beside_attention": True,
        **mamba_fields(config, heads, head_dim, inner, mamba_state_size=config.get("mamba_d_state", 256),
                       mamba_n_groups=config.get("mamba_n_groups", 1), mamba_conv_kernel=config.get("mamba_d_conv", 4),
                       mamba_chunk_size=config.get("mamba_chunk_size", 256),
                       mamba_proj_bias=config.get("mamba_proj_bias", False),
                       mamba_out_proj_bias=config.get("projectors_bias", False),
                       mamba_conv_bias=config.get("mamba_conv_bias", True),
                       mamba_gated_norm=config.get("mamba_rms_norm", False),
                       mamba_norm_before_gate=config.get("mamba_norm_before_gate", True),
                       mamba_norm_eps=config.get("rms_norm_eps", 1e-5)),
    }


def falcon_h1_mup_rows(config: dict) -> mx.array:
    """in_proj's output rows (z, x, B, C, dt) each times its ``ssm_multipliers`` entry."""
    heads, _, inner = falcon_h1_inner(config)
    groups = config.get("mamba_n_groups", 1) * config.get("mamba_d_state", 256)
    multipliers = config.get("ssm_multipliers") or [1.0] * 5
    sizes = (inner, inner, groups, groups, heads)
    return mx.concatenate([mx.full((size,), m, dtype=mx.float32) for size, m in zip(sizes, multipliers)])


def falcon_h1_multipliers(config: dict) -> list[tuple[str, float | mx.array, float | mx.array]]:
    """(tensor-name pattern, weight factor, bias factor): Falcon-H1's muP multipliers as
    factors of the tensors they scale. Input scalings reach weights, not biases."""
    attn_in, key = config.get("attention_in_multiplier", 1.0), config.get("key_multiplier", 1.0)
    attn_out, ssm_in = config.get("attention_out_multiplier", 1.0), config.get("ssm_in_multiplier", 1.0)
    ssm_out = config.get("ssm_out_multiplier", 1.0)
    gate, down = config.get("mlp_multipliers") or [1.0, 1.0]
    mup = falcon_h1_mup_rows(config)
    return [
        (r"model\.embed_tokens", config.get("embedding_multiplier", 1.0), 1.0),
        (r"lm_head", config.get("lm_head_multiplier", 1.0), 1.0),
        (r".*\.self_attn\.q_proj", attn_in, 1.0),
        (r".*\.self_attn\.k_proj", attn_in * key, key),
        (r".*\.self_attn\.v_proj", attn_in, 1.0),
        (r".*\.self_attn\.o_proj", attn_out, attn_out),
        (r".*\.mamba\.in_proj", ssm_in * mup[:, None], mup),
        (r".*\.mamba\.out_proj", ssm_out, ssm_out),
        (r".*\.feed_forward\.gate_proj", gate, gate),
        (r".*\.feed_forward\.down_proj", down, down),
    ]


def falcon_h1_layout(weights: dict, config: dict) -> dict:
    """Hugging Face Falcon-H1 -> mlx-lm's on-disk layout: every muP multiplier folded into
    the tensor it scales (exactly: each is a scalar, or a factor per output row), the conv
    in MLX's layout. A checkpoint already in that layout (its conv so) passes unchanged."""
    conv = next((t for name, t in weights.items() if name.endswith("mamba.conv1d.weight")), None)
    if conv is None or conv.shape[-1] == 1:
        return weights
    factors = falcon_h1_multipliers(config)
    out = {}
    for name, tensor in conv_to_mlx_layout(weights).items():
        module, _, kind = name.rpartition(".")
        for pattern, weight_factor, bias_factor in factors:
            if re.fullmatch(pattern, module) and kind in ("weight", "bias"):
                factor = weight_factor if kind == "weight" else bias_factor
                tensor = (tensor.astype(mx.float32) * factor).astype(tensor.dtype)
                break
        out[name] = tensor
    return out


FALCON_H1_RENAMES = (
    (r"(.*)\.feed_forward\.(.*)", r"\1.mlp.\2"),
    (r"(.*)\.pre_ff_layernorm\.(.*)", r"\1.post_attention_layernorm.\2"),
    (r"model\.final_layernorm\.(.*)", r"model.norm.\1"),
)


def falcon_h1_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's falcon_h1 defaults head_dim, rope_theta and mamba_d_ssm to its own model's."""
    heads, head_dim, inner = falcon_h1_inner(config)
    return {"head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "rope_theta": rope_settings(config)["rope_theta"], "mamba_d_ssm": inner, "mamba_d_head": head_dim}


# Nemotron-H's layer kinds, as transformers 5 spells them (layers_block_type) and as the
# legacy hybrid_override_pattern letters do: M Mamba-2, * attention, - MLP, E experts.
NEMOTRON_H_KINDS = {"linear_attention": "mamba", "full_attention": "full_attention", "mlp": "mlp",
                    "mamba": "mamba", "attention": "full_attention", "moe": "moe",
                    "M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def nemotron_h_layers(config: dict) -> list[str]:
    """Each layer's kind: "mamba", "full_attention", "mlp" or "moe"."""
    kinds = config.get("layers_block_type") or config.get("hybrid_override_pattern")
    if not kinds:
        raise UserError("nemotron_h config has neither layers_block_type nor hybrid_override_pattern")
    unknown = sorted({k for k in kinds if k not in NEMOTRON_H_KINDS})
    if unknown:
        raise UserError(f"nemotron_h layers of kind {unknown[0]!r} are not supported "
                        "(Mamba-2, attention, MLP, experts only)")
    return [NEMOTRON_H_KINDS[k] for k in kinds]


def nemotron_h_experts(config: dict, kinds: list[str]) -> dict:
    """The "moe" layers: ungated squared-ReLU experts, a sigmoid router choosing by
    ``e_score_correction_bias`` within the best ``topk_group`` of ``n_group`` groups, and a
    shared expert; the "mlp" layers stay dense (mlp_only_layers)."""
    if "moe" not in kinds:
        return {}
    missing = [key for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size") if not config.get(key)]
    if missing:
        raw = config.get("layers_block_type") or config.get("hybrid_override_pattern")
        letter = next(k for k in raw if NEMOTRON_H_KINDS[k] == "moe")
        raise UserError(f"nemotron_h layers of kind {letter!r} are not supported without {', '.join(missing)}")
    if config.get("moe_latent_size") is not None:
        raise UserError("nemotron_h experts with moe_latent_size (a latent projection around them) are not supported")
    shared = config.get("moe_shared_expert_intermediate_size") if config.get("n_shared_experts") else 0
    return {
        "num_experts": config["n_routed_experts"],
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "router_scoring": "sigmoid",
        "routed_scaling_factor": config.get("routed_scaling_factor", 1.0),
        "n_group": config.get("n_group") or 1,
        "topk_group": config.get("topk_group") or 1,
        "norm_topk_prob": config.get("norm_topk_prob", True),
        "shared_expert_intermediate_size": shared or 0,
        "ungated_experts": True,
        "mlp_only_layers": [i for i, kind in enumerate(kinds) if kind != "moe"],
    }


def nemotron_h_args(config: dict) -> dict:
    """Nemotron-H: blocks of one sublayer each (a Mamba-2 mixer, attention without positions,
    or a squared-ReLU MLP), each pre-normed with its residual."""
    kinds = nemotron_h_layers(config)
    D = config["hidden_size"]
    heads, head_dim = config["mamba_num_heads"], config["mamba_head_dim"]
    return {
        "model_type": "nemotron_h",
        "vocab_size": config["vocab_size"],
        "hidden_size": D,
        "num_hidden_layers": len(kinds),
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads"),
        "head_dim": config.get("head_dim"),
        "intermediate_size": config["intermediate_size"],
        "hidden_act": activation(config.get("mlp_hidden_act", "relu2")),
        "ffn_gated": False,
        "mlp_bias": config.get("mlp_bias", False),
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "position_embedding": "none",
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        # an MLP or experts block's entry is unused
        "layer_types": ["full_attention" if k in ("mlp", "moe") else k for k in kinds],
        "block_sublayers": ["mlp" if k in ("mlp", "moe") else "mixer" for k in kinds],
        **nemotron_h_experts(config, kinds),
        # transformers' NemotronHMamba2Mixer clips dt at time_step_min, never above
        **mamba_fields({**config, "time_step_limit": (config.get("time_step_min", 0.001), float("inf"))},
                       heads, head_dim, heads * head_dim, mamba_state_size=config["ssm_state_size"],
                       mamba_n_groups=config.get("n_groups", 8), mamba_conv_kernel=config.get("conv_kernel", 4),
                       mamba_chunk_size=config.get("chunk_size", 128), mamba_proj_bias=config.get("use_bias", False),
                       mamba_out_proj_bias=config.get("use_bias", False),
                       mamba_conv_bias=config.get("use_conv_bias", True),
                       mamba_norm_eps=config.get("layer_norm_epsilon", 1e-5)),
    }


LAYER_MIXER = re.compile(r"model\.layers\.(\d+)\.mixer\.(.*)")


def mixers_by_layer_kind(weights: dict, args: ModelArgs) -> dict:
    """Nemotron-H names every block's one sublayer ``mixer``; ours are named by kind
    (``mamba``, ``self_attn``, ``mlp``), which only the layer's entry in args tells."""
    out = {}
    for name, tensor in weights.items():
        match = LAYER_MIXER.fullmatch(name)
        if match is not None:
            layer = int(match[1])
            if args.block_sublayers[layer] == "mlp":
                kind = "mlp"
            else:
                kind = "mamba" if args.layer_types[layer] in ("mamba", "mamba1") else "self_attn"
            name = f"model.layers.{layer}.{kind}.{match[2]}"
        out[name] = tensor
    return out


NEMOTRON_H_EXPERT_PROJECTIONS = {"up_proj": "fc1", "down_proj": "fc2"}  # mlx-lm's SwitchMLP names
# Our names for the experts blocks' parts, once their sublayer is named ``mlp``.
NEMOTRON_H_MOE_NAMES = (
    (re.compile(r"(.*\.mlp)\.switch_mlp\.fc1\.(.*)"), r"\1.switch_mlp.up_proj.\2"),
    (re.compile(r"(.*\.mlp)\.switch_mlp\.fc2\.(.*)"), r"\1.switch_mlp.down_proj.\2"),
    (re.compile(r"(.*\.mlp)\.gate\.e_score_correction_bias"), r"\1.e_score_correction_bias"),
    (re.compile(r"(.*\.mlp)\.shared_experts\.(.*)"), r"\1.shared_expert.\2"),
)


def nemotron_h_layout(weights: dict, config: dict) -> dict:
    """Per-expert ``mixer.experts.N.up_proj/down_proj`` -> stacked ``mixer.switch_mlp.fc1/fc2``
    (mlx-lm's on-disk names); checkpoints without experts pass unchanged."""
    if not config.get("n_routed_experts"):
        return weights
    return stack_experts(weights, config["n_routed_experts"], NEMOTRON_H_EXPERT_PROJECTIONS)


def nemotron_h_sublayers(weights: dict, args: ModelArgs) -> dict:
    """``mixer`` named by layer kind, then the experts blocks' parts by our names."""
    out = {}
    for name, tensor in mixers_by_layer_kind(weights, args).items():
        for pattern, replacement in NEMOTRON_H_MOE_NAMES:
            if pattern.fullmatch(name):
                name = pattern.sub(replacement, name)
                break
        out[name] = tensor
    return out


BACKBONE_RENAMES = (
    (r"backbone\.embeddings?\.(.*)", r"model.embed_tokens.\1"),  # older exports: backbone.embedding
    (r"backbone\.norm_f\.(.*)", r"model.norm.\1"),
    (r"backbone\.layers\.(\d+)\.norm\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"backbone\.layers\.(\d+)\.mixer\.(.*)", r"model.layers.\1.mixer.\2"),
)


def nemotron_h_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's nemotron_h requires these keys, which transformers 5 may leave out."""
    return {"time_step_limit": [config.get("time_step_min", 0.001), float("inf")],
            "attention_bias": config.get("attention_bias", False), "mlp_bias": config.get("mlp_bias", False),
            "use_bias": config.get("use_bias", False), "use_conv_bias": config.get("use_conv_bias", True)}


def mamba2_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's mamba2 requires intermediate_size, and reads time_step_limit as two numbers."""
    return {"intermediate_size": int(config.get("expand", 2) * config["hidden_size"]),
            "time_step_limit": list(time_step_limit(config))}


# Config keys mlx-lm reads that transformers 5 writes differently or not at all (families/mlx_lm.py).
STATE_SPACE_MLX_LM_KEYS = {
    "mamba2": mamba2_mlx_lm_keys,
    "nemotron_h": nemotron_h_mlx_lm_keys,
    "granitemoehybrid": granite_hybrid_mlx_lm_keys,
    "falcon_h1": falcon_h1_mlx_lm_keys,
}

# State-space families, by model_type.
STATE_SPACE: dict[str, Architecture] = {
    "mamba": Architecture(args=mamba_args, renames=BACKBONE_RENAMES, rewrite=mixers_by_layer_kind,
                          layout=conv_to_mlx_layout),
    "mamba2": Architecture(args=mamba2_args, renames=BACKBONE_RENAMES, rewrite=mixers_by_layer_kind,
                           layout=conv_to_mlx_layout),
    "nemotron_h": Architecture(args=nemotron_h_args, renames=BACKBONE_RENAMES, rewrite=nemotron_h_sublayers,
                               layout=conv_to_mlx_layout, experts=nemotron_h_layout,
                               drops=COMMON_DROPS + (r"mtp\..*",),
                               routers=r"backbone\.layers\.\d+\.mixer\.gate", router_bits=None),
    "granitemoehybrid": Architecture(args=granite_hybrid_args, renames=GRANITE_HYBRID_RENAMES, rewrite=split_shared_mlp,
                                     experts=granite_hybrid_layout,
                                     routers=r"model\.layers\.\d+\.block_sparse_moe\.router\.layer"),
    "falcon_h1": Architecture(args=falcon_h1_args, renames=FALCON_H1_RENAMES, experts=falcon_h1_layout),
}
