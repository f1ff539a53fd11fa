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
}


def activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise UserError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rope_settings(config: dict) -> dict:
    """rope_theta, rope_scaling and partial_rotary_factor from either the classic keys or
    transformers 5's ``rope_parameters`` (which holds all of them)."""
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


# Names that are not weights of ours: precomputed RoPE tables some exports carry.
COMMON_DROPS = (r".*\.rotary_emb\.inv_freq",)


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


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(args=llama_args),  # Llama 1/2/3/3.x, TinyLlama, SmolLM
    "mistral": Architecture(args=llama_args),
    "qwen2": Architecture(args=qwen2_args),
    "qwen3": Architecture(args=qwen3_args),
    "gemma": Architecture(args=gemma_args),
    "gemma2": Architecture(args=gemma2_args),
    "phi3": Architecture(args=phi3_args, rewrite=phi3_rewrite),
    "gpt2": Architecture(args=gpt2_args, renames=GPT2_RENAMES, rewrite=split_qkv, layout=gpt2_layout),
}


# Config keys mlx-lm requires that transformers 5 no longer writes: key -> the key it equals.
MLX_LM_CONFIG_ALIASES = {
    "gpt2": {"n_ctx": "n_positions"},
}


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
    return arch.layout(weights) if arch.layout is not None else weights


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
