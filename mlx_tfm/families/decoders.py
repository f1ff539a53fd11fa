"""Decoder-only families with dense feed-forwards (Llama, Qwen, Gemma, Phi, GPT-2, ...):
each family's config -> ``ModelArgs`` fields, and its renames and rewrites."""

from __future__ import annotations

import re

from ..errors import UserError
from ..model.config import ModelArgs
from .common import (
    COMMON_DROPS,
    VISION_DROPS,
    Architecture,
    activation,
    rope_settings,
    split_rows,
)


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


# transformers' Olmo3Config.default_theta: the base of any layer type the config gives none.
OLMO3_DEFAULT_THETA = 500_000.0


def olmo3_args(config: dict) -> dict:
    """OLMo 2 with sliding-window layers (three in four), which rotate unscaled. Their base
    is the sliding layers' own ``rope_parameters`` entry; a config in the older layout
    (``rope_theta`` and ``rope_scaling`` at the top) gives them transformers 5's default
    base, as transformers 5 reads such a file (the released checkpoints use that base for
    every layer, so for them both readings agree)."""
    n_layers = config["num_hidden_layers"]
    three_in_four = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
    args = olmo2_args({"rope_theta": OLMO3_DEFAULT_THETA, **config})
    return {
        **args,
        # a GGUF file's one base arrives as rope_local_base_freq (convert/gguf_file.py)
        "rope_local_theta": args.get("rope_local_theta", config.get("rope_local_base_freq", OLMO3_DEFAULT_THETA)),
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


def saved_language_model_name(name: str) -> str:
    """transformers 5's in-memory name of an image-text model's language-model tensor
    (``model.language_model.*``, ``lm_head.*``) -> transformers 4's and mlx-lm's
    (``language_model.model.*``, ``language_model.lm_head.*``); any other name as it is."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    return name


def gemma3_layout(weights: dict) -> dict:
    """A Gemma 3 image-text model's names as transformers 4 and mlx-lm save them
    (``saved_language_model_name``); those pass through."""
    return {saved_language_model_name(name): tensor for name, tensor in weights.items()}


# Decoder-only families with dense feed-forwards, by model_type.
DECODERS: dict[str, Architecture] = {
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
}


# -- Cohere 2, GLM-4, GPT-NeoX (llama4 branch) ------------------------------------------


def cohere2_args(config: dict) -> dict:
    """Command R7B: Cohere's parallel block with sliding-window layers that rotate and every
    ``sliding_window_pattern``-th layer global, without positions."""
    n_layers, pattern = config["num_hidden_layers"], config.get("sliding_window_pattern", 4)
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    return {
        **cohere_args(config),
        "sliding_window": config.get("sliding_window", 4096),
        "layer_types": layer_types,
        "rope_layers": [t == "sliding_attention" for t in layer_types],
    }


def glm4_args(config: dict) -> dict:
    """GLM-4-0414: each sublayer's output normalised too (the sandwich placement), RoPE over
    adjacent pairs of half of each head, biases on q, k and v only."""
    return {
        **llama_args({"partial_rotary_factor": 0.5, **config}),
        "norm_placement": "sandwich",
        "rope_traditional": True,
        "attention_bias": config.get("attention_bias", True),
        "attention_out_bias": False,
        "norm_eps": config.get("rms_norm_eps", 1.5625e-07),
    }


def glm4_rewrite(weights: dict, args: ModelArgs) -> dict:
    # gate_up_proj holds gate then up (Glm4MLP chunks its output in two, gate first).
    F = args.intermediate_size
    return split_rows(weights, "gate_up_proj", {"gate_proj": F, "up_proj": F})


# GLM-4's four norms -> the sandwich placement's: its post_attention_layernorm is the one
# before the MLP.
GLM4_RENAMES = (
    (r"(.*)\.post_attention_layernorm\.(.*)", r"\1.pre_feedforward_layernorm.\2"),
    (r"(.*)\.post_self_attn_layernorm\.(.*)", r"\1.post_attention_layernorm.\2"),
    (r"(.*)\.post_mlp_layernorm\.(.*)", r"\1.post_feedforward_layernorm.\2"),
)


def gpt_neox_args(config: dict) -> dict:
    """Pythia, GPT-NeoX: LayerNorm with biases, a two-layer GELU MLP, biases everywhere,
    rotary over the first ``rotary_pct`` of each head (halves), and (by default) the
    parallel block with one norm for each sublayer."""
    theta = config.get("rotary_emb_base", 10000.0)
    partial = config.get("rotary_pct", 0.25)
    return {
        **config,
        **rope_settings({"rope_theta": theta, "partial_rotary_factor": partial, **config}),
        "norm_type": "layernorm",
        "norm_eps": config.get("layer_norm_eps", 1e-5),
        "norm_placement": "parallel_two_norms" if config.get("use_parallel_residual", True) else "pre",
        "hidden_act": activation(config.get("hidden_act", "gelu")),
        "ffn_gated": False,
        "mlp_bias": True,
        "attention_bias": config.get("attention_bias", True),
        "attention_out_bias": config.get("attention_bias", True),
        "num_key_value_heads": config["num_attention_heads"],
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


def gpt_neox_split_qkv(weights: dict, args: ModelArgs) -> dict:
    """``query_key_value`` rows are grouped per head, (n_heads, 3, head_dim): head h's
    query, key and value rows in turn -> q_proj, k_proj, v_proj. Quantized rows (and their
    scales and biases) split alike."""
    pattern = re.compile(r"(.*)\.query_key_value\.(weight|bias|scales|biases)")
    out = {}
    for name, tensor in weights.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        n_heads, head_dim = args.num_attention_heads, args.head_dim
        # (3 * D, ...) -> (n_heads, 3, head_dim, ...)
        grouped = tensor.reshape(n_heads, 3, head_dim, *tensor.shape[1:])
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{prefix}.{part}.{kind}"] = grouped[:, i].reshape(n_heads * head_dim, *tensor.shape[1:])
    return out


GPT_NEOX_LAYER = r"gpt_neox\.layers\.(\d+)"
GPT_NEOX_RENAMES = (
    (r"gpt_neox\.embed_in\.(.*)", r"model.embed_tokens.\1"),
    (r"gpt_neox\.final_layer_norm\.(.*)", r"model.norm.\1"),
    (r"embed_out\.(.*)", r"lm_head.\1"),
    (rf"{GPT_NEOX_LAYER}\.attention\.dense\.(.*)", r"model.layers.\1.self_attn.o_proj.\2"),
    (rf"{GPT_NEOX_LAYER}\.attention\.(.*)", r"model.layers.\1.self_attn.\2"),
    (rf"{GPT_NEOX_LAYER}\.mlp\.dense_h_to_4h\.(.*)", r"model.layers.\1.mlp.up_proj.\2"),
    (rf"{GPT_NEOX_LAYER}\.mlp\.dense_4h_to_h\.(.*)", r"model.layers.\1.mlp.down_proj.\2"),
    (rf"{GPT_NEOX_LAYER}\.(.*)", r"model.layers.\1.\2"),
)
# transformers 4's causal-mask buffers, saved by older Pythia checkpoints.
GPT_NEOX_DROPS = COMMON_DROPS + (r".*\.attention\.(bias|masked_bias)",)

DECODERS.update({
    "cohere2": Architecture(args=cohere2_args),
    "glm4": Architecture(args=glm4_args, renames=GLM4_RENAMES, rewrite=glm4_rewrite),
    "gpt_neox": Architecture(args=gpt_neox_args, renames=GPT_NEOX_RENAMES, rewrite=gpt_neox_split_qkv,
                             drops=GPT_NEOX_DROPS),
})


def apertus_args(config: dict) -> dict:
    """Apertus: Llama's pre-norm block under other norm names, q/k norm per head, and an
    ungated MLP with the learned xIELU activation."""
    return {
        **llama_args({"hidden_act": "xielu", **config}),
        "qk_norm": True,
        "ffn_gated": False,
        "mlp_bias": config.get("mlp_bias", False),
    }


def apertus_rewrite(weights: dict, args: ModelArgs) -> dict:
    # mlx-lm stores xIELU's alpha_p and alpha_n as scalars; transformers (and we) as (1,).
    return {name: t.reshape(1) if re.fullmatch(r".*\.act_fn\.alpha_[pn]", name) else t for name, t in weights.items()}


APERTUS_RENAMES = (
    (r"(.*)\.attention_layernorm\.(.*)", r"\1.input_layernorm.\2"),
    (r"(.*)\.feedforward_layernorm\.(.*)", r"\1.post_attention_layernorm.\2"),
)

DECODERS.update({"apertus": Architecture(args=apertus_args, renames=APERTUS_RENAMES, rewrite=apertus_rewrite)})
