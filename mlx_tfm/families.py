"""How each Hugging Face ``model_type`` maps onto the one model: a declarative table.

An entry says which ``ModelArgs`` fields the checkpoint's config.json implies, and how its
tensor names map onto ours (``None`` drops a tensor). Everything else is shared.

Two layouts matter for a checkpoint:
- the *on-disk* layout the converter writes: the one mlx-lm writes for that model_type, so
  mlx-lm loads our folders (for most families that is the Hugging Face layout itself; gpt2
  gets its Conv1D weights transposed and a ``model.`` prefix, as mlx-lm's gpt2 stores it;
  phi3 keeps its fused ``qkv_proj`` / ``gate_up_proj``). ``Architecture.layout`` turns a
  Hugging Face checkpoint into it and leaves an on-disk one unchanged.
- *our* module names: ``renames`` and ``rewrite`` turn the on-disk layout into them when
  the model is loaded. Fused tensors are split by rows, which also splits quantized
  weights, their scales and biases, so quantized folders load the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from mlx_tfm.errors import UserError
from mlx_tfm.model import ModelArgs

# Hugging Face activation names -> ours.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
}


def activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise UserError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rope_settings(config: dict) -> dict:
    """rope_theta, rope_scaling and partial_rotary_factor from either the classic keys or
    transformers 5's ``rope_parameters`` (which holds all of them, or one set per layer type:
    then the full-attention layers' set is the model's and the sliding layers' set gives
    ``rope_local_theta``)."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        return {**flat_rope_settings({**config, "rope_parameters": params["full_attention"]}),
                **local_rope_settings(params.get("sliding_attention"))}
    return flat_rope_settings(config)


def local_rope_settings(params: dict | None) -> dict:
    if not params:
        return {}
    if params.get("rope_type", "default") != "default":
        raise UserError(f"sliding-window layers with {params['rope_type']!r} RoPE scaling are not supported")
    return {"rope_local_theta": params["rope_theta"]}


def flat_rope_settings(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor", 1.0)
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial}


def llama_args(config: dict) -> dict:
    return {
        **config,
        **rope_settings(config),
        "norm_type": "rmsnorm",
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "hidden_act": activation(config.get("hidden_act", "silu")),
        "attention_out_bias": config.get("attention_bias", False),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


def qwen_sliding(config: dict) -> dict:
    """Qwen keeps ``sliding_window`` in its config even when ``use_sliding_window`` is off;
    when on, the layers from ``max_window_layers`` up slide."""
    if not config.get("use_sliding_window"):
        return {"sliding_window": None, "layer_types": None}
    n_layers, first = config["num_hidden_layers"], config.get("max_window_layers", 0)
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return {"sliding_window": config.get("sliding_window"), "layer_types": config.get("layer_types") or default}


def qwen2_args(config: dict) -> dict:
    # q, k and v carry biases, the output projection does not.
    return {**llama_args(config), "attention_bias": True, "attention_out_bias": False, **qwen_sliding(config)}


def qwen3_args(config: dict) -> dict:
    return {**llama_args(config), "qk_norm": True, **qwen_sliding(config)}


def gemma_args(config: dict) -> dict:
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act == "gelu":  # Gemma's own code always ran the tanh approximation for "gelu"
        act = "gelu_pytorch_tanh"
    return {
        **llama_args({**config, "hidden_act": act}),
        "norm_weight_offset": 1.0,  # RMSNorm scales by (1 + weight)
        "embedding_scale": config["hidden_size"] ** 0.5,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def gemma2_args(config: dict) -> dict:
    n_layers = config["num_hidden_layers"]
    # transformers 4 configs have no layer_types: even layers slide.
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    return {
        **gemma_args(config),
        "norm_placement": "sandwich",
        "attention_scale": config.get("query_pre_attn_scalar", config.get("head_dim", 256)) ** -0.5,
        "attn_logit_softcapping": config.get("attn_logit_softcapping"),
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "sliding_window": config.get("sliding_window"),
        "layer_types": config.get("layer_types") or alternating,
    }


def gemma3_text_args(config: dict) -> dict:
    """Gemma 3: Gemma 2's sandwich norms and pre-attention scalar, q/k norm, and local
    (sliding) layers rotating with their own base. Hub configs leave out keys that equal
    transformers' defaults, so those are filled in first."""
    config = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if config.get("use_bidirectional_attention"):
        raise UserError("gemma3 with use_bidirectional_attention (an embedding model) is not supported")
    pattern, n_layers = config["sliding_window_pattern"], config["num_hidden_layers"]
    every_nth_full = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    args = gemma2_args({**config, "layer_types": config.get("layer_types") or every_nth_full})
    return {"rope_local_theta": config["rope_local_base_freq"], **args, "qk_norm": True}


# transformers' Gemma3TextConfig defaults (hub configs rely on them, text_config above all).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


def gemma3_args(config: dict) -> dict:
    """The language model of a Gemma 3 image-text checkpoint (its ``text_config``)."""
    text = config.get("text_config") or {}
    return {**gemma3_text_args(text), "model_type": config["model_type"]}


def olmo2_args(config: dict) -> dict:
    # Norms after each sublayer only; q/k norm over the whole projection; o_proj has the bias too.
    return {**llama_args(config), "norm_placement": "post_sublayer", "qk_norm": True, "qk_norm_scope": "projection"}


def olmo3_args(config: dict) -> dict:
    """OLMo 2 with sliding-window layers (three in four), which rotate unscaled."""
    n_layers = config["num_hidden_layers"]
    three_in_four = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
    args = olmo2_args(config)
    return {
        **args,
        "rope_local_theta": args.get("rope_local_theta", args["rope_theta"]),
        "sliding_window": config.get("sliding_window", 4096),
        "layer_types": config.get("layer_types") or three_in_four,
    }


def exaone4_args(config: dict) -> dict:
    """Norms after each sublayer, q/k norm per head; with a sliding window only the sliding
    layers rotate (the global ones use no positions)."""
    n_layers, window = config["num_hidden_layers"], config.get("sliding_window")
    layer_types = config.get("layer_types") or exaone4_layer_types(config.get("sliding_window_pattern"), n_layers, window)
    return {
        **llama_args(config),
        "norm_placement": "post_sublayer",
        "qk_norm": True,
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_layers": [t == "sliding_attention" for t in layer_types] if window else [],
    }


def exaone4_layer_types(pattern, n_layers: int, window: int | None) -> list[str]:
    if not window:
        return ["full_attention"] * n_layers
    if isinstance(pattern, str):  # e.g. "LLLG", repeated from layer 0
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n_layers)]
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]


def starcoder2_args(config: dict) -> dict:
    bias = config.get("use_bias", True)
    return {
        **config,
        **rope_settings(config),
        "norm_type": "layernorm",
        "norm_eps": config.get("norm_epsilon", 1e-5),
        "hidden_act": activation(config.get("hidden_act", "gelu_pytorch_tanh")),
        "ffn_gated": False,
        "mlp_bias": bias,
        "attention_bias": bias,
        "attention_out_bias": bias,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def granite_args(config: dict) -> dict:
    return {
        **llama_args(config),
        "embedding_scale": config.get("embedding_multiplier", 1.0),
        "residual_scale": config.get("residual_multiplier", 1.0),
        "attention_scale": config.get("attention_multiplier", 1.0),
        "logit_scale": 1.0 / config.get("logits_scaling", 1.0),
    }


def smollm3_args(config: dict) -> dict:
    """Llama with every ``no_rope_layer_interval``-th layer unrotated; HF's ``no_rope_layers``
    holds 1 for the layers that *do* rotate."""
    n_layers, interval = config["num_hidden_layers"], config.get("no_rope_layer_interval", 4)
    rotates = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
    sliding = {"sliding_window": None, "layer_types": None}
    if config.get("use_sliding_window") and config.get("sliding_window"):
        default = ["full_attention" if r else "sliding_attention" for r in rotates]
        sliding = {"sliding_window": config["sliding_window"], "layer_types": config.get("layer_types") or default}
    return {**llama_args(config), "rope_layers": rotates, **sliding, "tie_word_embeddings": config.get("tie_word_embeddings", True)}


def phi_args(config: dict) -> dict:
    """Phi-1/1.5/2: LayerNorm, attention and MLP side by side on one norm, partial rotary,
    biases everywhere, the head included."""
    if config.get("qk_layernorm"):
        raise UserError("phi with qk_layernorm is not supported")
    return {
        **config,
        **rope_settings(config),
        "norm_type": "layernorm",
        "norm_eps": config.get("layer_norm_eps", 1e-5),
        "norm_placement": "parallel",
        "hidden_act": activation(config.get("hidden_act", "gelu_new")),
        "ffn_gated": False,
        "mlp_bias": True,
        "attention_bias": True,
        "attention_out_bias": True,
        "lm_head_bias": True,
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


def cohere_args(config: dict) -> dict:
    """Command-R: LayerNorm without bias, parallel attention and MLP, interleaved RoPE,
    scaled logits."""
    if config.get("use_qk_norm"):
        raise UserError("cohere with use_qk_norm is not supported")
    return {
        **llama_args(config),
        "norm_type": "layernorm",
        "norm_bias": False,
        "norm_eps": config.get("layer_norm_eps", 1e-5),
        "norm_placement": "parallel",
        "rope_traditional": True,
        "logit_scale": config.get("logit_scale", 0.0625),
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def stablelm_args(config: dict) -> dict:
    if config.get("qk_layernorm"):
        raise UserError("stablelm with qk_layernorm is not supported")
    return {
        **llama_args(config),
        "norm_type": "layernorm",
        "norm_eps": config.get("layer_norm_eps", 1e-5),
        "norm_placement": "parallel" if config.get("use_parallel_residual") else "pre",
        "attention_bias": config.get("use_qkv_bias", False),
        "attention_out_bias": False,
    }


def helium_args(config: dict) -> dict:
    # q/k/v carry attention_bias, o_proj never; RoPE over adjacent pairs.
    return {**llama_args(config), "attention_out_bias": False, "rope_traditional": True}


def seed_oss_args(config: dict) -> dict:
    return {
        **llama_args(config),
        "attention_bias": config.get("attention_bias", True),
        "attention_out_bias": config.get("attention_out_bias", False),
    }


def arcee_args(config: dict) -> dict:
    # AFM: a two-layer MLP with squared ReLU instead of SwiGLU.
    return {**llama_args({**config, "hidden_act": config.get("hidden_act", "relu2")}), "ffn_gated": False}


def phi3_args(config: dict) -> dict:
    return {**llama_args(config), "norm_eps": config.get("rms_norm_eps", 1e-5)}


def gpt2_args(config: dict) -> dict:
    D = config["n_embd"]
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise UserError("gpt2 configs with scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn are not supported")
    return {
        "model_type": "gpt2",
        "vocab_size": config["vocab_size"],
        "hidden_size": D,
        "num_hidden_layers": config["n_layer"],
        "num_attention_heads": config["n_head"],
        "intermediate_size": config.get("n_inner") or 4 * D,
        "norm_type": "layernorm",
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "hidden_act": activation(config.get("activation_function", "gelu_new")),
        "ffn_gated": False,
        "mlp_bias": True,
        "attention_bias": True,
        "attention_out_bias": True,
        "position_embedding": "learned",
        "max_position_embeddings": config.get("n_positions", 1024),
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


# -- layouts and rewrites ------------------------------------------------------------

GPT2_CONV1D = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")
GPT2_BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def gpt2_layout(weights: dict) -> dict:
    """Hugging Face gpt2 (``transformer.h.0...`` or ``h.0...``, Conv1D weights stored
    (in, out)) -> mlx-lm's gpt2 layout (``model.h.0...``, Linear weights (out, in)).
    Names already under ``model.`` are on-disk layout and pass through."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("model."):
            out[name] = tensor
            continue
        name = name.removeprefix("transformer.")
        if GPT2_BUFFERS.fullmatch(name) or name == "lm_head.weight":  # causal-mask buffers; tied head
            continue
        out[f"model.{name}"] = tensor.T if GPT2_CONV1D.fullmatch(name) else tensor
    return out


def split_rows(weights: dict, fused: str, parts: dict[str, int]) -> dict:
    """Split every ``*.{fused}.{weight,bias,scales,biases}`` by rows into ``parts``
    (name -> number of output features). Quantized rows split like float ones."""
    pattern = re.compile(rf"(.*)\.{fused}\.(weight|bias|scales|biases)")
    total = sum(parts.values())
    out = {}
    for name, tensor in weights.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        if tensor.shape[0] != total:
            raise UserError(f"shape mismatch for {name}: {tensor.shape[0]} rows, expected {total}")
        start = 0
        for part, rows in parts.items():
            out[f"{prefix}.{part}.{kind}"] = tensor[start : start + rows]
            start += rows
    return out


def split_qkv(weights: dict, args: ModelArgs) -> dict:
    q_rows = args.num_attention_heads * args.head_dim
    kv_rows = args.num_key_value_heads * args.head_dim
    return split_rows(weights, "qkv_proj", {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows})


def phi3_rewrite(weights: dict, args: ModelArgs) -> dict:
    # gate_up_proj holds gate then up: Phi3MLP chunks its output in two, gate first.
    F = args.intermediate_size
    return split_rows(split_qkv(weights, args), "gate_up_proj", {"gate_proj": F, "up_proj": F})


GPT2_RENAMES = (
    (r"model\.wte\.(.*)", r"model.embed_tokens.\1"),
    (r"model\.wpe\.(.*)", r"model.embed_positions.\1"),
    (r"model\.ln_f\.(.*)", r"model.norm.\1"),
    (r"model\.h\.(\d+)\.ln_1\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"model\.h\.(\d+)\.ln_2\.(.*)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"model\.h\.(\d+)\.attn\.c_attn\.(.*)", r"model.layers.\1.self_attn.qkv_proj.\2"),
    (r"model\.h\.(\d+)\.attn\.c_proj\.(.*)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"model\.h\.(\d+)\.mlp\.c_fc\.(.*)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"model\.h\.(\d+)\.mlp\.c_proj\.(.*)", r"model.layers.\1.mlp.down_proj.\2"),
)


STARCODER2_RENAMES = (
    (r"(.*)\.mlp\.c_fc\.(.*)", r"\1.mlp.up_proj.\2"),
    (r"(.*)\.mlp\.c_proj\.(.*)", r"\1.mlp.down_proj.\2"),
)
PHI_RENAMES = (
    (r"(.*)\.self_attn\.dense\.(.*)", r"\1.self_attn.o_proj.\2"),
    (r"(.*)\.mlp\.fc1\.(.*)", r"\1.mlp.up_proj.\2"),
    (r"(.*)\.mlp\.fc2\.(.*)", r"\1.mlp.down_proj.\2"),
    (r"model\.final_layernorm\.(.*)", r"model.norm.\1"),
)
# Gemma 3 image-text checkpoints, in mlx-lm's layout (transformers 4's): the text model
# under language_model.
GEMMA3_RENAMES = (
    (r"language_model\.model\.(.*)", r"model.\1"),
    (r"language_model\.lm_head\.(.*)", r"lm_head.\1"),
)


def gemma3_layout(weights: dict) -> dict:
    """transformers 5's names for a Gemma 3 image-text model (``model.language_model.*``,
    ``lm_head.*``) -> transformers 4's and mlx-lm's (``language_model.model.*``,
    ``language_model.lm_head.*``); those pass through."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name.removeprefix("model.language_model.")
        elif name.startswith("lm_head."):
            name = "language_model." + name
        out[name] = tensor
    return out


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


# -- encoders (the BERT family) and encoder-decoders (T5) ---------------------------------
# On disk these keep Hugging Face's names (a converted folder loads in transformers as it
# is); the renames map them onto the one model's names and the heads' (mlx_tfm/heads.py):
# ``lm_head.{dense,norm,bias}`` for masked LM, ``classifier.{dense,norm,out_proj}`` for
# sequence classification. A checkpoint's other head is dropped (BERT's pooler and NSP
# layer when the MLM head is built, the MLM head when a classifier is).


def encoder_head(config: dict) -> dict:
    """The head transformers' ``architectures`` names: ``*ForMaskedLM`` / ``*ForPreTraining``
    -> masked LM, ``*ForSequenceClassification`` -> classification (with its labels), else
    none (hidden states, as ``*Model`` and sentence-transformers folders)."""
    name = (config.get("architectures") or [""])[0]
    if name.endswith("ForSequenceClassification"):
        labels = len(config.get("id2label") or {}) or config.get("num_labels") or 2
        return {"head": "classification", "num_labels": labels}
    if name.endswith(("ForMaskedLM", "ForPreTraining")):
        return {"head": "masked_lm"}
    return {"head": "none"}


def bert_args(config: dict) -> dict:
    """BERT: learned positions and token types, a LayerNorm over the embeddings, post-norm
    LayerNorm blocks with biases everywhere, exact GELU."""
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"{config['model_type']} with position_embedding_type "
                        f"{config['position_embedding_type']!r} is not supported (only absolute)")
    act = activation(config.get("hidden_act", "gelu"))
    return {
        "model_type": config["model_type"], "kind": "encoder",
        "vocab_size": config.get("vocab_size", 30522), "hidden_size": config.get("hidden_size", 768),
        "num_hidden_layers": config.get("num_hidden_layers", 12),
        "num_attention_heads": config.get("num_attention_heads", 12),
        "intermediate_size": config.get("intermediate_size", 3072),
        "max_position_embeddings": config.get("max_position_embeddings", 512),
        "type_vocab_size": config.get("type_vocab_size", 2),
        "norm_type": "layernorm", "norm_eps": config.get("layer_norm_eps", 1e-12), "norm_placement": "post",
        "final_norm": False, "embedding_norm": True, "position_embedding": "learned",
        "hidden_act": act, "ffn_gated": False, "mlp_bias": True, "attention_bias": True, "attention_out_bias": True,
        "tie_word_embeddings": True, "head_activation": act, "classifier_activation": "tanh",
        **encoder_head(config),
    }


def roberta_args(config: dict) -> dict:
    """RoBERTa and XLM-R: BERT whose positions start after the padding index; the MLM
    head's activation is always GELU."""
    padding_idx = config.get("pad_token_id", 1)
    return {**bert_args({"type_vocab_size": 1, **config}), "position_offset": padding_idx + 1,
            "head_activation": "gelu"}


def distilbert_args(config: dict) -> dict:
    """DistilBERT: BERT without token types, in its own config keys; ReLU before its classifier."""
    keys = {"hidden_size": config.get("dim", 768), "num_hidden_layers": config.get("n_layers", 6),
            "num_attention_heads": config.get("n_heads", 12), "intermediate_size": config.get("hidden_dim", 3072),
            "hidden_act": config.get("activation", "gelu"), "type_vocab_size": 0, "layer_norm_eps": 1e-12}
    return {**bert_args({**config, **keys}), "classifier_activation": "relu"}


def modernbert_args(config: dict) -> dict:
    """ModernBERT: pre-norm LayerNorm without bias (none before layer 0's attention: the
    embeddings are normed), GeGLU, RoPE with a global and a local base, every
    ``global_attn_every_n_layers``-th layer global, the others a sliding window of
    ``local_attention`` (half on each side)."""
    n_layers = config.get("num_hidden_layers", 22)
    every = config.get("global_attn_every_n_layers", 3)
    layer_types = config.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                                 for i in range(n_layers)]
    rope = rope_settings(config)
    if "rope_parameters" not in config or "full_attention" not in (config.get("rope_parameters") or {}):
        rope = {**rope, "rope_theta": config.get("global_rope_theta", 160000.0),
                "rope_local_theta": config.get("local_rope_theta", 10000.0)}
    act = activation(config.get("hidden_activation", "gelu"))
    return {
        "model_type": "modernbert", "kind": "encoder",
        "vocab_size": config.get("vocab_size", 50368), "hidden_size": config.get("hidden_size", 768),
        "num_hidden_layers": n_layers, "num_attention_heads": config.get("num_attention_heads", 12),
        "intermediate_size": config.get("intermediate_size", 1152),
        "max_position_embeddings": config.get("max_position_embeddings", 8192), **rope,
        "norm_type": "layernorm", "norm_eps": config.get("norm_eps", 1e-5), "norm_bias": config.get("norm_bias", False),
        "embedding_norm": True, "first_layer_norm": False,
        "hidden_act": act, "ffn_gated": True, "mlp_bias": config.get("mlp_bias", False),
        "attention_bias": config.get("attention_bias", False), "attention_out_bias": config.get("attention_bias", False),
        "sliding_window": config.get("local_attention", 128) // 2, "layer_types": layer_types,
        "tie_word_embeddings": True, "head_activation": activation(config.get("classifier_activation", "gelu")),
        "head_bias": config.get("classifier_bias", False), "decoder_bias": config.get("decoder_bias", True),
        "classifier_pooling": config.get("classifier_pooling", "cls"),
        "classifier_activation": activation(config.get("classifier_activation", "gelu")), "classifier_norm": True,
        **encoder_head(config),
    }


def t5_args(config: dict) -> dict:
    """T5 (v1.0: ReLU, tied head read at d_model^-0.5) and v1.1 / flan-t5 / mT5 (gated
    tanh-GELU, their own LM head, no rescale): RMSNorm pre-norm blocks without biases,
    unscaled attention scores, relative position buckets instead of positions."""
    ff = config.get("feed_forward_proj", "relu")
    gated = ff.startswith("gated-")
    act = "gelu_tanh" if ff == "gated-gelu" else activation(ff.split("-")[-1])
    rescaled = config["model_type"] == "t5" and config.get(
        "scale_decoder_outputs", config.get("tie_word_embeddings", True) is not False)
    D = config.get("d_model", 512)
    n_layers = config.get("num_layers", 6)
    return {
        "model_type": config["model_type"], "kind": "encoder-decoder",
        "vocab_size": config.get("vocab_size", 32128), "hidden_size": D, "num_hidden_layers": n_layers,
        "num_decoder_layers": config.get("num_decoder_layers") or n_layers,
        "num_attention_heads": config.get("num_heads", 8), "head_dim": config.get("d_kv", 64),
        "intermediate_size": config.get("d_ff", 2048),
        "norm_type": "rmsnorm", "norm_eps": config.get("layer_norm_epsilon", 1e-6),
        "hidden_act": act, "ffn_gated": gated, "attention_scale": 1.0, "position_embedding": "none",
        "relative_attention_num_buckets": config.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": config.get("relative_attention_max_distance", 128),
        "tie_word_embeddings": rescaled, "logit_scale": D**-0.5 if rescaled else 1.0,
        "decoder_start_token_id": config.get("decoder_start_token_id") or config.get("pad_token_id") or 0,
    }


def encoder_renames(prefix: str, layer: str, parts: dict[str, str]) -> tuple:
    """Renames of a BERT-like checkpoint: ``prefix`` (optional in the names, absent in a
    bare ``*Model``), ``layer`` (the blocks' path) and ``parts`` (their path in a block ->
    ours)."""
    p = rf"(?:{prefix}\.)?"
    return tuple((rf"{p}{layer}\.(\d+)\.{theirs}\.(.*)", rf"model.layers.\1.{ours}.\2") for theirs, ours in parts.items())


BERT_LAYER_PARTS = {
    r"attention\.self\.query": "self_attn.q_proj", r"attention\.self\.key": "self_attn.k_proj",
    r"attention\.self\.value": "self_attn.v_proj", r"attention\.output\.dense": "self_attn.o_proj",
    r"attention\.output\.LayerNorm": "input_layernorm", r"intermediate\.dense": "mlp.up_proj",
    r"output\.dense": "mlp.down_proj", r"output\.LayerNorm": "post_attention_layernorm",
}


def bert_embedding_renames(prefix: str) -> tuple:
    p = rf"(?:{prefix}\.)?"
    return (
        (rf"{p}embeddings\.word_embeddings\.(.*)", r"model.embed_tokens.\1"),
        (rf"{p}embeddings\.position_embeddings\.(.*)", r"model.embed_positions.\1"),
        (rf"{p}embeddings\.token_type_embeddings\.(.*)", r"model.embed_token_types.\1"),
        (rf"{p}embeddings\.LayerNorm\.(.*)", r"model.embed_norm.\1"),
        (rf"{p}embeddings\.(position_ids|token_type_ids)", None),
    )


BERT_RENAMES = (
    *bert_embedding_renames("bert"), *encoder_renames("bert", r"encoder\.layer", BERT_LAYER_PARTS),
    (r"(?:bert\.)?pooler\.dense\.(.*)", r"classifier.dense.\1"),  # BERT's classifier reads the pooler
    (r"cls\.predictions\.transform\.dense\.(.*)", r"lm_head.dense.\1"),
    (r"cls\.predictions\.transform\.LayerNorm\.(.*)", r"lm_head.norm.\1"),
    (r"cls\.predictions\.bias", r"lm_head.bias"),
    (r"cls\.predictions\.decoder\..*", None),  # tied to the word embeddings; its bias is the one above
    (r"cls\.seq_relationship\..*", None),  # next-sentence prediction
    (r"classifier\.(weight|bias)", r"classifier.out_proj.\1"),
)
ROBERTA_RENAMES = (
    *bert_embedding_renames("roberta"), *encoder_renames("roberta", r"encoder\.layer", BERT_LAYER_PARTS),
    (r"(?:roberta\.)?pooler\..*", None),  # RoBERTa's classifier has its own dense layer
    (r"lm_head\.layer_norm\.(.*)", r"lm_head.norm.\1"),
    (r"lm_head\.decoder\..*", None),
)
DISTILBERT_RENAMES = (
    *bert_embedding_renames("distilbert"),
    *encoder_renames("distilbert", r"transformer\.layer", {
        r"attention\.q_lin": "self_attn.q_proj", r"attention\.k_lin": "self_attn.k_proj",
        r"attention\.v_lin": "self_attn.v_proj", r"attention\.out_lin": "self_attn.o_proj",
        r"sa_layer_norm": "input_layernorm", r"ffn\.lin1": "mlp.up_proj", r"ffn\.lin2": "mlp.down_proj",
        r"output_layer_norm": "post_attention_layernorm",
    }),
    (r"vocab_transform\.(.*)", r"lm_head.dense.\1"),
    (r"vocab_layer_norm\.(.*)", r"lm_head.norm.\1"),
    (r"vocab_projector\.bias", r"lm_head.bias"),
    (r"vocab_projector\.weight", None),
    (r"pre_classifier\.(.*)", r"classifier.dense.\1"),
    (r"classifier\.(weight|bias)", r"classifier.out_proj.\1"),
)
MODERNBERT_RENAMES = (
    (r"(?:model\.)?embeddings\.tok_embeddings\.(.*)", r"model.embed_tokens.\1"),
    (r"(?:model\.)?embeddings\.norm\.(.*)", r"model.embed_norm.\1"),
    *encoder_renames("model", "layers", {
        r"attn_norm": "input_layernorm", r"attn\.Wqkv": "self_attn.qkv_proj", r"attn\.Wo": "self_attn.o_proj",
        r"mlp_norm": "post_attention_layernorm", r"mlp\.Wi": "mlp.gate_up_proj", r"mlp\.Wo": "mlp.down_proj",
    }),
    (r"(?:model\.)?final_norm\.(.*)", r"model.norm.\1"),
    (r"decoder\.bias", r"lm_head.bias"),
    (r"decoder\.weight", None),  # tied to the token embeddings
    (r"classifier\.(weight|bias)", r"classifier.out_proj.\1"),
)
T5_RENAMES = (
    (r"(encoder|decoder)\.embed_tokens\.weight", None),  # the shared table
    (r"(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.(.*)",
     r"\1.relative_attention_bias.\2"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.(q|k|v|o)\.(.*)", r"\1.layers.\2.self_attn.\3_proj.\4"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.layer_norm\.(.*)", r"\1.layers.\2.input_layernorm.\3"),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.(q|k|v|o)\.(.*)", r"decoder.layers.\1.cross_attn.\2_proj.\3"),
    (r"decoder\.block\.(\d+)\.layer\.1\.layer_norm\.(.*)", r"decoder.layers.\1.cross_attn_layernorm.\2"),
    (r"encoder\.block\.(\d+)\.layer\.1\.layer_norm\.(.*)", r"encoder.layers.\1.post_attention_layernorm.\2"),
    (r"decoder\.block\.(\d+)\.layer\.2\.layer_norm\.(.*)", r"decoder.layers.\1.post_attention_layernorm.\2"),
    *((rf"{stack}\.block\.(\d+)\.layer\.{sublayer}\.DenseReluDense\.{theirs}\.(.*)", rf"{stack}.layers.\1.mlp.{ours}.\2")
      for stack, sublayer in (("encoder", 1), ("decoder", 2))
      for theirs, ours in (("wi", "up_proj"), ("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))),
    (r"(encoder|decoder)\.final_layer_norm\.(.*)", r"\1.norm.\2"),
)


def drop_unbuilt_heads(weights: dict, args: ModelArgs) -> dict:
    """Keep the tensors of the head ``args.head`` builds, drop the other head's."""
    unbuilt = tuple(prefix for prefix, head in (("lm_head.", "masked_lm"), ("classifier.", "classification"))
                    if args.head != head)
    return {name: t for name, t in weights.items() if not name.startswith(unbuilt)}


def modernbert_rewrite(weights: dict, args: ModelArgs) -> dict:
    """ModernBERT's ``head`` is the classifier's dense layer and norm under a classifier
    and the masked-LM transform otherwise; fused Wqkv and Wi split by rows."""
    owner = "classifier." if args.head == "classification" else "lm_head."
    renamed = {(owner + name.removeprefix("head.") if name.startswith("head.") else name): t
               for name, t in weights.items()}
    F = args.intermediate_size
    split = split_rows(split_qkv(renamed, args), "gate_up_proj", {"gate_proj": F, "up_proj": F})
    return drop_unbuilt_heads(split, args)


def t5_rewrite(weights: dict, args: ModelArgs) -> dict:
    """An untied head that a checkpoint leaves out is the shared table, as transformers
    ties it then."""
    if not args.tie_word_embeddings and "lm_head.weight" not in weights and "shared.weight" in weights:
        return {**weights, "lm_head.weight": weights["shared.weight"]}
    return weights


# Names that are not weights of ours: precomputed RoPE tables some exports carry.
COMMON_DROPS = (r".*\.rotary_emb\.inv_freq",)
# The image side of image-text checkpoints: only the language model is loaded.
VISION_DROPS = (r"(model\.)?vision_tower\..*", r"(model\.)?multi_modal_projector\..*")


@dataclass(frozen=True)
class Architecture:
    args: Callable[[dict], dict]
    # (regex, replacement) pairs applied in order; a replacement of None drops the tensor.
    renames: tuple[tuple[str, str | None], ...] = ()
    drops: tuple[str, ...] = COMMON_DROPS
    # Optional whole-checkpoint rewrite for what a rename cannot say (fused tensors).
    rewrite: Callable[[dict, ModelArgs], dict] | None = field(default=None)
    # Optional Hugging Face layout -> on-disk (mlx-lm) layout; identity when None.
    layout: Callable[[dict], dict] | None = field(default=None)
    # Mixtures of experts: per-expert or fused Hugging Face experts -> stacked (weights, config).
    experts: Callable[[dict, dict], dict] | None = field(default=None)
    # On-disk module paths of the routers, which quantization keeps at ``router_bits`` (None:
    # float, where mlx-lm's router is no linear layer and cannot read a quantized one).
    routers: str | None = None
    router_bits: int | None = 8


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(args=llama_args),  # Llama 1/2/3/3.x, TinyLlama, SmolLM
    "mistral": Architecture(args=llama_args),
    "qwen2": Architecture(args=qwen2_args),
    "qwen3": Architecture(args=qwen3_args),
    "gemma": Architecture(args=gemma_args),
    "gemma2": Architecture(args=gemma2_args),
    "phi3": Architecture(args=phi3_args, rewrite=phi3_rewrite),
    "gpt2": Architecture(args=gpt2_args, renames=GPT2_RENAMES, rewrite=split_qkv, layout=gpt2_layout),
    "gemma3_text": Architecture(args=gemma3_text_args),
    "gemma3": Architecture(args=gemma3_args, renames=GEMMA3_RENAMES, drops=COMMON_DROPS + VISION_DROPS,
                           layout=gemma3_layout),
    "olmo2": Architecture(args=olmo2_args),
    "olmo3": Architecture(args=olmo3_args),
    "exaone4": Architecture(args=exaone4_args),
    "starcoder2": Architecture(args=starcoder2_args, renames=STARCODER2_RENAMES),
    "granite": Architecture(args=granite_args),
    "smollm3": Architecture(args=smollm3_args),
    "phi": Architecture(args=phi_args, renames=PHI_RENAMES),
    "cohere": Architecture(args=cohere_args),
    "stablelm": Architecture(args=stablelm_args),
    "helium": Architecture(args=helium_args),
    "seed_oss": Architecture(args=seed_oss_args),
    "ministral": Architecture(args=llama_args),  # Llama with sliding-window layers
    "arcee": Architecture(args=arcee_args),
    # encoders (kind "encoder") and encoder-decoders (kind "encoder-decoder"): mlx_tfm/encoders.py
    "bert": Architecture(args=bert_args, renames=BERT_RENAMES, rewrite=drop_unbuilt_heads),
    "roberta": Architecture(args=roberta_args, renames=ROBERTA_RENAMES, rewrite=drop_unbuilt_heads),
    "xlm-roberta": Architecture(args=roberta_args, renames=ROBERTA_RENAMES, rewrite=drop_unbuilt_heads),
    "distilbert": Architecture(args=distilbert_args, renames=DISTILBERT_RENAMES, rewrite=drop_unbuilt_heads),
    "modernbert": Architecture(args=modernbert_args, renames=MODERNBERT_RENAMES, rewrite=modernbert_rewrite),
    "t5": Architecture(args=t5_args, renames=T5_RENAMES, rewrite=t5_rewrite),  # t5, t5 v1.1, flan-t5
    "mt5": Architecture(args=t5_args, renames=T5_RENAMES, rewrite=t5_rewrite),
    "mixtral": Architecture(args=mixtral_args, renames=MIXTRAL_RENAMES, experts=mixtral_layout, routers=ROUTERS),
    "qwen2_moe": Architecture(args=qwen2_moe_args, experts=qwen_moe_layout, routers=ROUTERS),
    "qwen3_moe": Architecture(args=qwen3_moe_args, experts=qwen_moe_layout, routers=ROUTERS),
    "olmoe": Architecture(args=olmoe_args, experts=qwen_moe_layout, routers=ROUTERS),
    "gpt_oss": Architecture(args=gpt_oss_args, renames=GPT_OSS_RENAMES, experts=gpt_oss_layout, routers=ROUTERS),
    "glm4_moe": Architecture(args=glm4_moe_args, renames=GLM4_MOE_RENAMES, experts=glm4_moe_layout, routers=ROUTERS,
                             router_bits=None),
}


# Config keys mlx-lm requires that transformers 5 no longer writes: key -> the key it equals.
MLX_LM_CONFIG_ALIASES = {
    "gpt2": {"n_ctx": "n_positions"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
}


def period_of(layer_types: list[str]) -> int:
    """The shortest repeat of a layer-type list (its length when it does not repeat)."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1) if all(layer_types[i] == layer_types[i % p] for i in range(n)))


def layer_type_rope_keys(config: dict) -> dict:
    """transformers 5's per-layer-type ``rope_parameters`` in the classic keys mlx-lm reads."""
    params = config.get("rope_parameters") or {}
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    keys = {}
    if "rope_theta" in full:
        keys["rope_theta"] = full["rope_theta"]
    if full.get("rope_type", "default") != "default":
        keys["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if "rope_theta" in sliding:
        keys["rope_local_base_freq"] = sliding["rope_theta"]
    return keys


def gemma3_text_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's gemma3_text reads ``sliding_window_pattern`` (every n-th layer global), not
    ``layer_types``; written when the layer types follow that pattern."""
    keys = layer_type_rope_keys(config)
    layer_types = config.get("layer_types") or []
    if layer_types:
        n = period_of(layer_types)
        every_nth = ["sliding_attention"] * (n - 1) + ["full_attention"]
        if layer_types[:n] == every_nth:
            keys["sliding_window_pattern"] = n
    return keys


def gemma3_mlx_lm_keys(config: dict) -> dict:
    text = config.get("text_config") or {}
    vocab_size = config.get("vocab_size") or text.get("vocab_size", GEMMA3_TEXT_DEFAULTS["vocab_size"])
    return {"vocab_size": vocab_size, "text_config": {**text, **gemma3_text_mlx_lm_keys(text)}}


def exaone4_mlx_lm_keys(config: dict) -> dict:
    """mlx-lm's exaone4 needs head_dim and rope_scaling, and the window pattern as letters
    ("LLLG": L local, G global)."""
    keys = {"head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "rope_scaling": config.get("rope_scaling")}
    layer_types = config.get("layer_types") or []
    if config.get("sliding_window") and layer_types and not isinstance(config.get("sliding_window_pattern"), str):
        period = layer_types[: period_of(layer_types)]
        keys["sliding_window_pattern"] = "".join("L" if t == "sliding_attention" else "G" for t in period)
    return keys


# Config keys mlx-lm reads that transformers 5 writes differently or not at all, by model_type.
MLX_LM_CONFIG_KEYS: dict[str, Callable[[dict], dict]] = {
    "gemma3_text": gemma3_text_mlx_lm_keys,
    "gemma3": gemma3_mlx_lm_keys,
    "olmo3": layer_type_rope_keys,
    "exaone4": exaone4_mlx_lm_keys,
    "glm4_moe": lambda config: {"rope_scaling": None},  # a required field of mlx-lm's glm4_moe
}


def mlx_lm_config_keys(config: dict) -> dict:
    """Keys to set in a config.json we write so that mlx-lm reads it as we do (each only
    restates what the config already says, in the spelling mlx-lm reads)."""
    return MLX_LM_CONFIG_KEYS.get(config.get("model_type"), lambda _: {})(config)


def architecture_for(config: dict) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UserError(f"unknown model_type {model_type!r}; supported: {supported}")
    return ARCHITECTURES[model_type]


def model_args_from_config(config: dict) -> ModelArgs:
    """config.json (Hugging Face or mlx-lm) -> ModelArgs."""
    return ModelArgs.from_dict(architecture_for(config).args(config))


def on_disk_layout(config: dict, weights: dict) -> dict:
    """A checkpoint in its source layout -> the layout the converter writes (mlx-lm's)."""
    arch = architecture_for(config)
    drops = [re.compile(p) for p in arch.drops]
    weights = {k: v for k, v in weights.items() if not any(p.fullmatch(k) for p in drops)}
    weights = arch.layout(weights) if arch.layout is not None else weights
    return arch.experts(weights, config) if arch.experts is not None else weights


def map_weights(config: dict, args: ModelArgs, weights: dict) -> dict:
    """Rename, drop and rewrite a checkpoint's tensors into our names. Idempotent, so
    folders we wrote ourselves pass through unchanged."""
    arch = architecture_for(config)
    mapped = {}
    for name, tensor in on_disk_layout(config, weights).items():
        for pattern, replacement in arch.renames:
            if re.fullmatch(pattern, name):
                name = None if replacement is None else re.sub(pattern, replacement, name)
                break
        if name is not None:
            mapped[name] = tensor
    if args.tie_word_embeddings:
        mapped.pop("lm_head.weight", None)
    if arch.rewrite is not None:
        mapped = arch.rewrite(mapped, args)
    return mapped
