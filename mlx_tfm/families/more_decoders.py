"""More decoder-only families with dense feed-forwards (ERNIE 4.5, InternLM 3, Nemotron-4,
StarCoder 1, Ministral 3 and Mistral 3's text tower, HunYuan dense): each family's config -> ``ModelArgs``
fields, and its renames. Most are a mapping onto mechanisms the model already has."""

from __future__ import annotations

from ..errors import UserError
from .common import COMMON_DROPS, VISION_DROPS, Architecture, activation, rope_settings
from .decoders import GEMMA3_RENAMES, gemma2_args, gemma3_layout, gpt2_args, llama_args, phi3_rewrite, split_qkv


def ernie4_5_args(config: dict) -> dict:
    """ERNIE 4.5: Llama with RoPE over adjacent pairs and one ``use_bias`` for every
    projection; transformers' default head_dim (128) where a config leaves it out."""
    bias = config.get("use_bias", False)
    return {
        **llama_args({**config, "head_dim": config.get("head_dim") or 128}),
        "rope_traditional": True,
        "attention_bias": bias,
        "attention_out_bias": bias,
        "mlp_bias": bias,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def internlm3_args(config: dict) -> dict:
    """InternLM 3: Llama whose hub configs spell attention_bias ``qkv_bias`` (o_proj too,
    as transformers maps it) and mlp_bias ``bias``."""
    bias = config.get("qkv_bias", config.get("attention_bias", False))
    return {
        **llama_args({**config, "head_dim": config.get("head_dim") or 128}),
        "attention_bias": bias,
        "attention_out_bias": bias,
        "mlp_bias": config.get("bias", config.get("mlp_bias", False)),
    }


def iquestcoder_args(config: dict) -> dict:
    """IQuest-Coder: Llama under its own name (transformers and mlx-lm run it as Llama), with
    its config's default head_dim (128)."""
    return llama_args({**config, "head_dim": config.get("head_dim") or 128})


def exaone_args(config: dict) -> dict:
    """EXAONE 3 / 3.5: Llama in GPT-2-style tensor names, its hub configs spelling the layer
    count, norm epsilon and activation as ``num_layers``, ``layer_norm_epsilon``,
    ``activation_function`` (transformers writes the Llama names)."""
    spelled = {
        "num_hidden_layers": config.get("num_hidden_layers") or config["num_layers"],
        "rms_norm_eps": config.get("rms_norm_eps") or config.get("layer_norm_epsilon", 1e-5),
        "hidden_act": config.get("hidden_act") or config.get("activation_function", "silu"),
    }
    return llama_args({**config, **spelled})


# transformers' CwmConfig RoPE where a config has none: Llama 3 scaling of a 1M base.
CWM_ROPE = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def cwm_args(config: dict) -> dict:
    """Code World Model: Llama 3 with sliding-window layers, every 4th from layer 0 full."""
    if not config.get("rope_parameters") and not config.get("rope_scaling") and not config.get("rope_theta"):
        config = {**config, "rope_parameters": CWM_ROPE}
    n_layers, window = config["num_hidden_layers"], config.get("sliding_window", 8192)
    every_4th_full = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n_layers)]
    return {
        **llama_args({**config, "head_dim": config.get("head_dim") or 128, "attention_bias": False}),
        "sliding_window": window,
        "layer_types": config.get("layer_types") or every_4th_full,
    }


def vaultgemma_args(config: dict) -> dict:
    """VaultGemma: Gemma 2 without the norms after each sublayer (a pre-norm block whose
    second norm is named ``pre_feedforward_layernorm``)."""
    return {**gemma2_args(config), "norm_placement": "pre"}


def glm_args(config: dict) -> dict:
    """GLM-4 (2024, ``glm``): Llama with q/k/v biases (o_proj none), RoPE over adjacent pairs
    of the first half of each head (transformers' default), gate and up fused as Phi-3's."""
    rope = rope_settings(config)
    if "partial_rotary_factor" not in (config.get("rope_parameters") or {}) and "partial_rotary_factor" not in config:
        rope["partial_rotary_factor"] = 0.5
    return {
        **llama_args({**config, "head_dim": config.get("head_dim") or 128}),
        **rope,
        "attention_bias": config.get("attention_bias", True),
        "attention_out_bias": False,
        "rope_traditional": True,
    }


def nemotron_args(config: dict) -> dict:
    """Nemotron-4: LayerNorm1P (LayerNorm scaling by weight + 1), an ungated squared-ReLU
    MLP, RoPE over half of each head unless the config says otherwise."""
    rope = rope_settings(config)
    params = config.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in config:
        rope["partial_rotary_factor"] = 0.5  # transformers' default for Nemotron
    return {
        **llama_args(config),
        **rope,
        "norm_type": "layernorm",
        "norm_weight_offset": 1.0,
        "norm_eps": config.get("norm_eps", 1e-5),
        "hidden_act": activation(config.get("hidden_act", "relu2")),
        "ffn_gated": False,
        "mlp_bias": config.get("mlp_bias", False),
    }


def ministral3_args(config: dict) -> dict:
    """Ministral 3 (the text model of Mistral 3 / Ministral 3 checkpoints): Mistral with
    YaRN whose ``llama_4_scaling_beta`` also scales the queries up with the position."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta") or 0.0
    return {
        **llama_args({**config, "head_dim": config.get("head_dim") or 128}),
        "query_position_scale_beta": beta,
        "query_position_scale_period": params.get("original_max_position_embeddings", 0) if beta else 0,
    }


# The text models a Mistral 3 image-text checkpoint holds, by text_config's model_type.
MISTRAL3_TEXT_MODELS = {"ministral3": ministral3_args, "mistral": llama_args}


def mistral3_args(config: dict) -> dict:
    """The language model of a Mistral 3 image-text checkpoint (Ministral 3, Mistral Small
    3.1): its ``text_config``; the image side is dropped. transformers ties the head by the
    top-level ``tie_word_embeddings``."""
    text = config.get("text_config") or {}
    text_type = text.get("model_type", "mistral")
    if text_type not in MISTRAL3_TEXT_MODELS:
        supported = ", ".join(MISTRAL3_TEXT_MODELS)
        raise UserError(f"mistral3 with a {text_type!r} text model is not supported ({supported})")
    return {**MISTRAL3_TEXT_MODELS[text_type](text), "model_type": config["model_type"],
            "tie_word_embeddings": config.get("tie_word_embeddings", True)}


def hunyuan_rope(config: dict, head_dim: int) -> dict:
    """HunYuan's "dynamic" RoPE with a fixed ``alpha`` is NTK-aware: only the base grows,
    to theta * alpha^(d / (d - 2)), the same for every length."""
    rope = rope_settings(config)
    scaling = rope["rope_scaling"]
    if scaling is None:
        return rope
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind != "dynamic" or not scaling.get("alpha"):
        raise UserError(f"HunYuan with {kind!r} RoPE scaling is not supported (dynamic with alpha)")
    theta = rope["rope_theta"] * scaling["alpha"] ** (head_dim / (head_dim - 2))
    return {**rope, "rope_theta": theta, "rope_scaling": None}


def hunyuan_v1_dense_args(config: dict) -> dict:
    """HunYuan dense: Llama with q/k norm per head after RoPE (``query_layernorm`` /
    ``key_layernorm``) and NTK-alpha RoPE."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        **llama_args(config),
        **hunyuan_rope(config, head_dim),
        "qk_norm": config.get("use_qk_norm", True),
        "qk_norm_after_rope": config.get("use_qk_norm", True),
    }


def opt_args(config: dict) -> dict:
    """OPT: learned positions read two rows on (the table has two more), ReLU MLP, LayerNorm,
    biases by ``enable_bias``; pre-norm, or post-norm without a final norm
    (``do_layer_norm_before`` false)."""
    D = config["hidden_size"]
    if config.get("word_embed_proj_dim") not in (None, D):
        raise UserError("opt with word_embed_proj_dim other than hidden_size (project_in/out) is not supported")
    if not config.get("layer_norm_elementwise_affine", True):
        raise UserError("opt with layer_norm_elementwise_affine false is not supported")
    pre = config.get("do_layer_norm_before", True)
    bias = config.get("enable_bias", True)
    return {
        **config,
        "num_key_value_heads": config["num_attention_heads"],  # multi-head: one key/value head per query head
        "intermediate_size": config["ffn_dim"],
        "norm_type": "layernorm",
        "norm_placement": "pre" if pre else "post",
        "final_norm": pre and not config.get("_remove_final_layer_norm", False),
        "hidden_act": activation(config.get("activation_function", "relu")),
        "ffn_gated": False,
        "mlp_bias": bias,
        "attention_bias": bias,
        "attention_out_bias": bias,
        "position_embedding": "learned",
        "position_offset": 2,  # OPTLearnedPositionalEmbedding
        "max_position_embeddings": config.get("max_position_embeddings", 2048) + 2,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def gptj_args(config: dict) -> dict:
    """GPT-J: attention and MLP side by side on one LayerNorm, RoPE over adjacent pairs of
    the first ``rotary_dim`` dims of each head, no attention biases, a biased head."""
    D, n_heads = config["n_embd"], config["n_head"]
    rotary_dim = config.get("rotary_dim") or D // n_heads
    return {
        "model_type": "gptj",
        "vocab_size": config["vocab_size"],
        "hidden_size": D,
        "num_hidden_layers": config["n_layer"],
        "num_attention_heads": n_heads,
        "intermediate_size": config.get("n_inner") or 4 * D,
        "norm_type": "layernorm",
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "norm_placement": "parallel",
        "hidden_act": activation(config.get("activation_function", "gelu_new")),
        "ffn_gated": False,
        "mlp_bias": True,
        "lm_head_bias": True,
        "rope_traditional": True,
        "partial_rotary_factor": rotary_dim / (D // n_heads),
        "max_position_embeddings": config.get("n_positions", 2048),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


def biogpt_args(config: dict) -> dict:
    """BioGPT: OPT's learned positions two rows on, embeddings times sqrt(hidden_size),
    pre-norm LayerNorms at torch's default epsilon (transformers never passes the config's)."""
    act = config.get("hidden_act", "gelu")
    return {
        **opt_args({**config, "ffn_dim": config["intermediate_size"], "activation_function": act}),
        "norm_eps": 1e-5,
        "embedding_scale": config["hidden_size"] ** 0.5 if config.get("scale_embedding", True) else None,
        "max_position_embeddings": config.get("max_position_embeddings", 1024) + 2,
    }


def gpt_bigcode_args(config: dict) -> dict:
    """StarCoder 1 / SantaCoder: GPT-2's block (LayerNorm, GELU MLP, learned positions,
    biases) with one key/value head (``multi_query``) in a fused ``c_attn``."""
    if not config.get("scale_attn_weights", True):
        raise UserError("gpt_bigcode with scale_attn_weights false is not supported")
    multi_query = config.get("multi_query", True)
    return {**gpt2_args({"activation_function": "gelu_pytorch_tanh", **config}), "model_type": "gpt_bigcode",
            "num_key_value_heads": 1 if multi_query else config["n_head"]}


# StarCoder 1 keeps transformers' names on disk (mlx-lm's gpt_bigcode reads them as they are).
GPT_BIGCODE_RENAMES = (
    (r"transformer\.wte\.(.*)", r"model.embed_tokens.\1"),
    (r"transformer\.wpe\.(.*)", r"model.embed_positions.\1"),
    (r"transformer\.ln_f\.(.*)", r"model.norm.\1"),
    (r"transformer\.h\.(\d+)\.ln_1\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"transformer\.h\.(\d+)\.ln_2\.(.*)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"transformer\.h\.(\d+)\.attn\.c_attn\.(.*)", r"model.layers.\1.self_attn.qkv_proj.\2"),
    (r"transformer\.h\.(\d+)\.attn\.c_proj\.(.*)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc\.(.*)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_proj\.(.*)", r"model.layers.\1.mlp.down_proj.\2"),
)
EXAONE_RENAMES = (
    (r"transformer\.wte\.(.*)", r"model.embed_tokens.\1"),
    (r"transformer\.ln_f\.(.*)", r"model.norm.\1"),
    (r"transformer\.h\.(\d+)\.ln_1\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"transformer\.h\.(\d+)\.ln_2\.(.*)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"transformer\.h\.(\d+)\.attn\.attention\.out_proj\.(.*)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"transformer\.h\.(\d+)\.attn\.attention\.(.*)", r"model.layers.\1.self_attn.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc_0\.(.*)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc_1\.(.*)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.c_proj\.(.*)", r"model.layers.\1.mlp.down_proj.\2"),
)
VAULTGEMMA_RENAMES = ((r"(.*)\.pre_feedforward_layernorm\.(.*)", r"\1.post_attention_layernorm.\2"),)
OPT_RENAMES = (
    (r"model\.decoder\.embed_tokens\.(.*)", r"model.embed_tokens.\1"),
    (r"model\.decoder\.embed_positions\.(.*)", r"model.embed_positions.\1"),
    (r"model\.decoder\.final_layer_norm\.(.*)", r"model.norm.\1"),
    (r"model\.decoder\.layers\.(\d+)\.self_attn\.out_proj\.(.*)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"model\.decoder\.layers\.(\d+)\.self_attn_layer_norm\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"model\.decoder\.layers\.(\d+)\.final_layer_norm\.(.*)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"model\.decoder\.layers\.(\d+)\.fc1\.(.*)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"model\.decoder\.layers\.(\d+)\.fc2\.(.*)", r"model.layers.\1.mlp.down_proj.\2"),
    (r"model\.decoder\.layers\.(.*)", r"model.layers.\1"),
)
GPTJ_RENAMES = (
    (r"transformer\.wte\.(.*)", r"model.embed_tokens.\1"),
    (r"transformer\.ln_f\.(.*)", r"model.norm.\1"),
    (r"transformer\.h\.(\d+)\.ln_1\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"transformer\.h\.(\d+)\.attn\.out_proj\.(.*)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"transformer\.h\.(\d+)\.attn\.(q_proj|k_proj|v_proj)\.(.*)", r"model.layers.\1.self_attn.\2.\3"),
    (r"transformer\.h\.(\d+)\.mlp\.fc_in\.(.*)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"transformer\.h\.(\d+)\.mlp\.fc_out\.(.*)", r"model.layers.\1.mlp.down_proj.\2"),
)
# BioGPT: OPT's layer names under ``biogpt.``, the tied head named output_projection.
BIOGPT_RENAMES = (
    (r"output_projection\.weight", None),
    (r"biogpt\.layer_norm\.(.*)", r"model.norm.\1"),
    (r"biogpt\.embed_tokens\.(.*)", r"model.embed_tokens.\1"),
    (r"biogpt\.embed_positions\.(.*)", r"model.embed_positions.\1"),
    (r"biogpt\.layers\.(\d+)\.self_attn\.out_proj\.(.*)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"biogpt\.layers\.(\d+)\.self_attn_layer_norm\.(.*)", r"model.layers.\1.input_layernorm.\2"),
    (r"biogpt\.layers\.(\d+)\.final_layer_norm\.(.*)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"biogpt\.layers\.(\d+)\.fc1\.(.*)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"biogpt\.layers\.(\d+)\.fc2\.(.*)", r"model.layers.\1.mlp.down_proj.\2"),
    (r"biogpt\.layers\.(.*)", r"model.layers.\1"),
)
HUNYUAN_RENAMES = (
    (r"(.*)\.self_attn\.query_layernorm\.(.*)", r"\1.self_attn.q_norm.\2"),
    (r"(.*)\.self_attn\.key_layernorm\.(.*)", r"\1.self_attn.k_norm.\2"),
)
# causal-mask buffers older exports carry
GPT_BIGCODE_DROPS = COMMON_DROPS + (r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",)


# More decoder-only families with dense feed-forwards, by model_type.
MORE_DECODERS: dict[str, Architecture] = {
    "ernie4_5": Architecture(args=ernie4_5_args),
    "internlm3": Architecture(args=internlm3_args),
    "iquestcoder": Architecture(args=iquestcoder_args),
    "cwm": Architecture(args=cwm_args),
    "gptj": Architecture(args=gptj_args, renames=GPTJ_RENAMES, drops=GPT_BIGCODE_DROPS),  # on disk in its own names
    "opt": Architecture(args=opt_args, renames=OPT_RENAMES),
    "biogpt": Architecture(args=biogpt_args, renames=BIOGPT_RENAMES),
    "glm": Architecture(args=glm_args, rewrite=phi3_rewrite),  # gate_up_proj fused on disk, as mlx-lm's glm
    "vaultgemma": Architecture(args=vaultgemma_args, renames=VAULTGEMMA_RENAMES),
    "exaone": Architecture(args=exaone_args, renames=EXAONE_RENAMES),  # on disk in its own names, as mlx-lm reads
    "nemotron": Architecture(args=nemotron_args),
    "ministral3": Architecture(args=ministral3_args),
    "hunyuan_v1_dense": Architecture(args=hunyuan_v1_dense_args, renames=HUNYUAN_RENAMES),
    # on disk as mlx-lm's mistral3 keeps it (transformers 4's names, as Gemma 3's): language_model.*
    "mistral3": Architecture(args=mistral3_args, renames=GEMMA3_RENAMES, drops=COMMON_DROPS + VISION_DROPS,
                             layout=gemma3_layout),
    "gpt_bigcode": Architecture(args=gpt_bigcode_args, renames=GPT_BIGCODE_RENAMES, drops=GPT_BIGCODE_DROPS,
                                rewrite=split_qkv),
}
