"""llama.cpp's GGUF files of still more families, under llama.cpp's architecture names:
gpt-oss, gpt2, starcoder (StarCoder 1, gpt_bigcode), gptj, phimoe, exaone, exaone-moe
(K-EXAONE), dots1, hunyuan-moe, mistral3 (Ministral 3's text model), nemotron_h_moe
(Nemotron-H with experts layers), kimi-linear, read back into the names their families load
(``mlx_tfm.families``); the encoders' rows (bert, t5) are in ``gguf_encoders.py``.

Each row of ``MORE_FAMILY_ARCHITECTURES`` holds the fields of one ``GGUFArchitecture``
(``gguf_file.py`` builds them), as ``gguf_families.py``'s rows do. What llama.cpp's
converters did to the tensors, and how it is read back:

- gpt-oss: the experts' interleaved ``gate_up_proj`` (experts, D, 2F) is written split
  (even columns gate, odd up) and transposed, ``down_proj`` transposed: mlx-lm's stacked
  (experts, out, in) layout under ``mlp.experts.*``, which the family loads as it is;
  the sinks gain a ``.weight`` (dropped again). llama.cpp runs every other layer sliding,
  layer 0 first, as the checkpoints do.
- gpt2: GPT-2's Conv1D weights (in, out) are written transposed, as Linear (out, in)
  weights: read into mlx-lm's gpt2 layout (``model.h.N...``), which holds them so.
- starcoder, gptj: the tensors as the checkpoint holds them, the fused ``c_attn`` of
  StarCoder kept fused (its family splits it).
- GPT-2, StarCoder and GPT-J converters write 4 x hidden as the feed-forward length
  whatever the model has: the up projection's shape tells.
- the mixtures' experts are stacked (experts, out, in) per projection, the families'
  ``switch_mlp`` layout; dots1's and exaone-moe's files write no expert groups, so
  llama.cpp routes without them and so does the import; K-EXAONE's appended prediction
  layers are dropped.
- what a file cannot say is filled in as llama.cpp's runtime fixes it: gpt-oss's even
  layers sliding, dots1 attending fully everywhere, Phi-3.5-MoE's sparsemixer jitter at
  transformers' default; HunYuan's NTK-alpha is already folded into the written base.
- nemotron_h_moe: Nemotron-H's Mamba-2 and attention layers as ``gguf_hybrids.py`` reads
  them; its experts layers (told by their router) hold ungated up/down experts, checked here
  (``own_expert_check``) rather than as gated ones; the experts' width is written as those
  layers' feed_forward_length, so a dense MLP layer's width comes from its tensor.
- kimi-linear: A = -exp(A_log) and the KDA convolutions (1, C, 1, K) put back; the MLA
  layers' kv_b_proj split per head (attn_k_b, attn_v_b) as deepseek2's, read in the split
  names the family takes; which layers are KDA the tensors tell (ssm_a).
- mistral3's YaRN log multiplier is the checkpoint's ``mscale_all_dim`` as it is (DeepSeek's
  converter writes a tenth of it), its temperature scale ``llama_4_scaling_beta``.
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import UserError
from .gguf_families import (
    ATTENTION,
    GATED_MLP,
    HEAD,
    drop_rope_freqs,
    exaone4_keys,
    layer_pairs,
    llama3_scaling_keys,
)
from .gguf_hybrids import (
    NEMOTRON_H_NAMES,
    layer_kinds,
    mamba2_beside_attention_keys,
    restore_nemotron_h,
)

NamePair = tuple[str, str]


def layer_names(prefix: str, pairs: list[tuple[str, str]]) -> tuple[NamePair, ...]:
    """``blk.N.{gguf}.weight|bias`` <-> ``{prefix}.N.{hf}.weight|bias`` for each pair."""
    return tuple((f"blk.{{layer}}.{g}.{{kind}}", f"{prefix}.{{layer}}.{h}.{{kind}}") for g, h in pairs)


def up_width(tensors: dict) -> int:
    """The feed-forward width from ``blk.0.ffn_up`` (ggml order: in, out)."""
    return up_width_of(tensors, 0)


def up_width_of(tensors: dict, layer: int) -> int:
    return int(tensors[f"blk.{layer}.ffn_up.weight"].shape[1])


# -- gpt-oss: attention sinks, sliding layers, experts with biases ---------------------------

GPT_OSS_NAMES = HEAD + (
    # the converter names the sinks a weight; restore_gpt_oss drops the suffix again
    ("blk.{layer}.attn_sinks.weight", "model.layers.{layer}.self_attn.sinks.weight"),
) + layer_pairs([
    ("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"), ("ffn_gate_inp", "mlp.router"),
    ("ffn_gate_exps", "mlp.experts.gate_proj"), ("ffn_up_exps", "mlp.experts.up_proj"),
    ("ffn_down_exps", "mlp.experts.down_proj"),
])


def gpt_oss_keys(get, base: dict, tensors: dict) -> dict:
    """GptOssModel writes the experts' width as expert_feed_forward_length and the window;
    llama.cpp makes even layers slide."""
    n_layers = base["num_hidden_layers"]
    return {
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": int(get("expert_feed_forward_length")),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
    }


def restore_gpt_oss(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    return {name.removesuffix(".weight") if name.endswith(".self_attn.sinks.weight") else name: data}


# -- GPT-2 and StarCoder 1: learned positions, LayerNorms, a fused qkv -----------------------

GPT2_NAMES = (
    ("token_embd.weight", "model.wte.weight"),
    ("position_embd.weight", "model.wpe.weight"),
    ("output_norm.{kind}", "model.ln_f.{kind}"),
    ("output.weight", "lm_head.weight"),
) + layer_names("model.h", [
    ("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_norm", "ln_2"),
    ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj"),
])
STARCODER_NAMES = tuple((g, "transformer." + h.removeprefix("model.")) if h.startswith("model.") else (g, h)
                        for g, h in GPT2_NAMES)


def gpt2_keys(get, base: dict, tensors: dict) -> dict:
    """GPT2Model writes GPT-2's own keys' values: widths, layers, heads, context, eps."""
    return {
        "n_embd": int(get("embedding_length")),
        "n_layer": int(get("block_count")),
        "n_head": int(get("attention.head_count")),
        "n_positions": int(get("context_length")),
        "n_inner": up_width(tensors),
        "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
    }


def starcoder_keys(get, base: dict, tensors: dict) -> dict:
    """StarCoderModel: GPT-2's keys and one KV head (multi-query) or as many as queries."""
    n_heads = int(get("attention.head_count"))
    return {**gpt2_keys(get, base, tensors), "multi_query": int(get("attention.head_count_kv", n_heads)) == 1}


# -- GPT-J: attention and MLP side by side, RoPE over adjacent pairs of the first dims -------

GPTJ_NAMES = (
    ("token_embd.weight", "transformer.wte.weight"),
    ("output_norm.{kind}", "transformer.ln_f.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
) + layer_names("transformer.h", [
    ("attn_norm", "ln_1"), ("attn_q", "attn.q_proj"), ("attn_k", "attn.k_proj"), ("attn_v", "attn.v_proj"),
    ("attn_output", "attn.out_proj"), ("ffn_up", "mlp.fc_in"), ("ffn_down", "mlp.fc_out"),
])


def gptj_keys(get, base: dict, tensors: dict) -> dict:
    """GPTJModel: GPT-2's keys and the rotated dims of a head (rotary_dim)."""
    return {**gpt2_keys(get, base, tensors), "rotary_dim": int(get("rope.dimension_count"))}


def as_written(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """The tensor as the file holds it (a fused qkv left for the family to split)."""
    return {name: data}


# -- mixtures: experts stacked (experts, out, in) as llama.cpp writes them ---------------------


def stacked_experts(block: str) -> list[tuple[str, str]]:
    """``ffn_{gate,up,down}_exps`` -> ``{block}.switch_mlp.*``, the families' stacked layout."""
    return [(f"ffn_{p}_exps", f"{block}.switch_mlp.{p}_proj") for p in ("gate", "up", "down")]


def shared_experts(prefix: str) -> list[tuple[str, str]]:
    return [(f"ffn_{p}_shexp", f"{prefix}.{p}_proj") for p in ("gate", "up", "down")]


QK_NORMS = [("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")]
PRE_NORMS = [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]
CHOICE_BIAS = (("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.mlp.gate.e_score_correction_bias"),)


def expert_count_keys(get) -> dict:
    return {"num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length") or 0) or None}


# Phi-3.5-MoE: LayerNorms with biases, Mixtral's experts, biased attention and head
PHIMOE_NAMES = HEAD + layer_pairs([*PRE_NORMS, *ATTENTION, ("ffn_gate_inp", "block_sparse_moe.gate"),
                                   *stacked_experts("block_sparse_moe")])


def phimoe_keys(get, base: dict, tensors: dict) -> dict:
    """PhiMoeModel is Phi3MiniModel's keys (LayerNorm's eps as the RMS eps, a window of 0
    for none) and the expert counts; the sparsemixer's jitter is no key (transformers'
    default, Phi-3.5-MoE's own)."""
    if "rope_factors_long.weight" in tensors:
        raise UserError("GGUF phimoe with LongRoPE factors (rope_factors_long / rope_factors_short) is not "
                        "supported: this runtime has no LongRoPE scaling")
    window = get("attention.sliding_window")
    return {
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "sliding_window": int(window) if window else None,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "lm_head_bias": "output.bias" in tensors,
    }


# EXAONE 3 / 3.5: Llama in GPT-2-style names; llama3 RoPE scaling as rope_freqs
EXAONE_NAMES = (
    ("token_embd.weight", "transformer.wte.weight"),
    ("output_norm.{kind}", "transformer.ln_f.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
    ("rope_freqs.weight", "rope_freqs.weight"),
) + layer_names("transformer.h", [
    ("attn_norm", "ln_1"), ("ffn_norm", "ln_2"), ("attn_q", "attn.attention.q_proj"),
    ("attn_k", "attn.attention.k_proj"), ("attn_v", "attn.attention.v_proj"),
    ("attn_output", "attn.attention.out_proj"), ("ffn_gate", "mlp.c_fc_0"), ("ffn_up", "mlp.c_fc_1"),
    ("ffn_down", "mlp.c_proj"),
])


def exaone_keys(get, base: dict, tensors: dict) -> dict:
    return llama3_scaling_keys(base, tensors)


# K-EXAONE (exaone-moe): EXAONE 4's attention in a pre-norm block, DeepSeek-V3's router,
# the prediction layers appended (dropped)
EXAONE_MOE_NAMES = HEAD + (("rope_freqs.weight", "rope_freqs.weight"),) + (
    ("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.mlp.e_score_correction_bias"),
) + layer_pairs([*PRE_NORMS, *ATTENTION, *QK_NORMS, *GATED_MLP, ("ffn_gate_inp", "mlp.gate"),
                 *stacked_experts("mlp"), *shared_experts("mlp.shared_experts")])


def deepseek_router_keys(get) -> dict:
    """What dots1 and exaone-moe write of DeepSeek-V3's router (no groups: llama.cpp runs none)."""
    return {
        "n_shared_experts": int(get("expert_shared_count") or 0),
        "first_k_dense_replace": int(get("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm") or False),
        "n_group": 1, "topk_group": 1,
        **expert_count_keys(get),
    }


def exaone_moe_keys(get, base: dict, tensors: dict) -> dict:
    """ExaoneMoEModel: Exaone4Model's window and sliding layers, the router's keys, the
    appended prediction layers counted in block_count."""
    n_layers = base["num_hidden_layers"] - int(get("nextn_predict_layers") or 0)
    router = deepseek_router_keys(get)
    keys = {**exaone4_keys(get, {**base, "num_hidden_layers": n_layers}, tensors), **router,
            "num_hidden_layers": n_layers, "num_experts": int(get("expert_count")),
            "num_shared_experts": router["n_shared_experts"]}
    return keys


# dots.llm1: Qwen 3's attention, DeepSeek-V3's router, leading dense layers
DOTS1_NAMES = HEAD + CHOICE_BIAS + layer_pairs([*PRE_NORMS, *ATTENTION, *QK_NORMS, *GATED_MLP,
                                                ("ffn_gate_inp", "mlp.gate"), *stacked_experts("mlp"),
                                                *shared_experts("mlp.shared_experts")])


def dots1_keys(get, base: dict, tensors: dict) -> dict:
    """Dots1Model writes Qwen2MoeModel's keys and the router's; no window (llama.cpp's dots1
    attends fully everywhere)."""
    return {"n_routed_experts": int(get("expert_count")), **deepseek_router_keys(get), "sliding_window": None}


# HunYuan MoE: HunYuan dense's attention, experts on every layer beside an ungated shared MLP
HUNYUAN_MOE_NAMES = HEAD + layer_pairs([*PRE_NORMS, *ATTENTION, *QK_NORMS, ("ffn_gate_inp", "mlp.gate.wg"),
                                        *stacked_experts("mlp"), *shared_experts("mlp.shared_mlp")])


def hunyuan_moe_keys(get, base: dict, tensors: dict) -> dict:
    """HunYuanMoEModel folds NTK-alpha into the base it writes (no scaling type): a plain base."""
    return {"num_experts": int(get("expert_count")), "moe_topk": int(get("expert_used_count")),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}


# Ministral 3 (mistral3): a permuted Llama with YaRN and the queries scaled up with position


def mistral3_keys(get, base: dict, tensors: dict) -> dict:
    """Ministral3Model writes the checkpoint's mscale_all_dim as the YaRN log multiplier
    as it is (DeepSeek's converter writes a tenth of it) and llama_4_scaling_beta as the
    attention temperature scale; the checkpoints' mscale equals their mscale_all_dim."""
    if get("rope.scaling.type") != "yarn":
        return {}
    log_mul = float(get("rope.scaling.yarn_log_multiplier") or 1.0)
    scaling = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
               "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
               "mscale": log_mul, "mscale_all_dim": log_mul,
               "llama_4_scaling_beta": float(get("attention.temperature_scale") or 0.0)}
    for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if get(key) is not None:
            scaling[hf_key] = float(get(key))
    return {"rope_scaling": scaling}


# Nemotron-H with experts (nemotron_h_moe): Nemotron-H's layers, and experts layers of
# ungated squared-ReLU experts beside a shared expert, chosen by sigmoid scores and a bias

NEMOTRON_H_MOE_NAMES = NEMOTRON_H_NAMES + (
    ("blk.{layer}.exp_probs_b.bias", "backbone.layers.{layer}.mixer.gate.e_score_correction_bias"),
) + layer_names("backbone.layers", [
    ("ffn_gate_inp", "mixer.gate"), ("ffn_up_exps", "mixer.switch_mlp.fc1"), ("ffn_down_exps", "mixer.switch_mlp.fc2"),
    ("ffn_up_shexp", "mixer.shared_experts.up_proj"), ("ffn_down_shexp", "mixer.shared_experts.down_proj"),
])
# Nemotron-H's pattern letters, the experts layers' (E) told by their router
NEMOTRON_H_MOE_KINDS = {"M": "ssm_in.weight", "*": "attn_q.weight", "E": "ffn_gate_inp.weight", "-": "ffn_up.weight"}


def nemotron_h_moe_keys(get, base: dict, tensors: dict) -> dict:
    """NemotronHModel with experts writes the experts' width as feed_forward_length (0 off
    the experts layers), so a dense MLP layer's width comes from its tensor; the router's
    groups (all of them when the file names no used count), the latent size when it has one
    (which the family names as unsupported)."""
    n_layers = int(get("block_count"))
    kinds = layer_kinds(tensors, n_layers, NEMOTRON_H_MOE_KINDS, "nemotron_h_moe")
    check_ungated_experts(tensors, [i for i, kind in enumerate(kinds) if kind == "E"], int(get("expert_count")))
    dense = [i for i, kind in enumerate(kinds) if kind == "-"]
    n_group = int(get("expert_group_count") or 1)
    eps = get("attention.layer_norm_rms_epsilon") or get("attention.layer_norm_epsilon") or 1e-5
    return {
        **mamba2_beside_attention_keys(get, tensors, ""),
        "hybrid_override_pattern": "".join(kinds),
        "intermediate_size": up_width_of(tensors, dense[0]) if dense else int(get("expert_feed_forward_length")),
        "layer_norm_epsilon": float(eps),
        "use_bias": "blk.0.ssm_in.bias" in tensors,
        "mlp_bias": any(n.endswith("ffn_up.bias") for n in tensors),
        "n_routed_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "moe_shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length") or 0),
        "n_shared_experts": int(get("expert_shared_count") or 0),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "n_group": n_group,
        "topk_group": int(get("expert_group_used_count") or n_group),
        "moe_latent_size": get("moe_latent_size"),
    }


# Kimi Linear (kimi-linear): Kimi Delta Attention layers and MLA layers without positions,
# DeepSeek-V3's router over Mixtral-named experts, the first layer(s) dense

KIMI_LINEAR_NAMES = HEAD + (
    ("blk.{layer}.ssm_a", "model.layers.{layer}.self_attn.A_log"),
    ("blk.{layer}.ssm_dt.bias", "model.layers.{layer}.self_attn.dt_bias"),
    ("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"),
) + layer_pairs([
    *PRE_NORMS, *ATTENTION, ("ssm_conv1d_q", "self_attn.q_conv1d"), ("ssm_conv1d_k", "self_attn.k_conv1d"),
    ("ssm_conv1d_v", "self_attn.v_conv1d"), ("ssm_f_a", "self_attn.f_a_proj"), ("ssm_f_b", "self_attn.f_b_proj"),
    ("ssm_beta", "self_attn.b_proj"), ("ssm_g_a", "self_attn.g_a_proj"), ("ssm_g_b", "self_attn.g_b_proj"),
    ("ssm_norm", "self_attn.o_norm"),
    ("attn_q_a", "self_attn.q_a_proj"), ("attn_q_b", "self_attn.q_b_proj"),
    ("attn_q_a_norm", "self_attn.q_a_layernorm"),
    ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"), ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
    # kv_b_proj whole, or split per head as deepseek2's: (H, R, nope) and (H, v, R)
    ("attn_kv_b", "self_attn.kv_b_proj"), ("attn_k_b", "self_attn.embed_q"), ("attn_v_b", "self_attn.unembed_out"),
    ("ffn_gate_inp", "block_sparse_moe.gate"), *stacked_experts("block_sparse_moe"),
    *shared_experts("block_sparse_moe.shared_experts"),
    ("ffn_gate", "block_sparse_moe.gate_proj"), ("ffn_up", "block_sparse_moe.up_proj"),
    ("ffn_down", "block_sparse_moe.down_proj"),
])


def kimi_linear_keys(get, base: dict, tensors: dict) -> dict:
    """KimiLinearModel writes head_count_kv per layer, 0 on the KDA layers and 1 on the MLA
    ones (MLA as MQA), the KDA head width and convolution, DeepSeek-V3's MLA widths (the
    cached latent's as key_length), the router's keys; no expert groups."""
    n_layers = base["num_hidden_layers"]
    kinds = layer_kinds(tensors, n_layers, {"linear_attention": "ssm_a", "full_attention": "attn_kv_a_mqa.weight"},
                        "kimi-linear")
    kda = kinds.index("linear_attention") if "linear_attention" in kinds else None
    rope = int(get("rope.dimension_count"))
    n_dense = int(get("leading_dense_block_count") or 0)
    return {
        "num_key_value_heads": base["num_attention_heads"],
        "layer_types": kinds,
        "linear_num_heads": int(np.prod(tensors[f"blk.{kda}.ssm_a"].shape)) if kda is not None else 1,
        "linear_head_dim": int(get("kda.head_dim") or 128),
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel") or 4),
        "q_lora_rank": int(get("attention.q_lora_rank") or 0) or None,
        "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(get("attention.key_length_mla")) - rope,
        "v_head_dim": int(get("attention.value_length_mla")),
        "head_dim": rope,  # transformers' KimiLinearConfig: the rotated part
        "num_experts": int(get("expert_count")),
        "num_experts_per_token": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "num_shared_experts": int(get("expert_shared_count") or 0),
        "first_k_dense_replace": n_dense,
        "mlp_layer_types": ["dense" if i < n_dense else "sparse" for i in range(n_layers)],
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "moe_renormalize": bool(get("expert_weights_norm", True)),
        "num_expert_group": 1, "topk_group": 1,
    }


def restore_kimi_linear(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """A = -exp(A_log) back to A_log; the KDA convolutions, written (1, C, 1, K), as the
    checkpoint's (C, 1, K)."""
    if name.endswith(".A_log"):
        return {name: np.log(-np.asarray(data, dtype=np.float32))}
    if name.endswith("_conv1d.weight"):
        return {name: np.asarray(data).reshape(data.shape[1], 1, data.shape[-1])}  # (C, 1, K)
    return {name: data}


def check_ungated_experts(tensors: dict, layers: list[int], n_experts: int) -> None:
    """Each experts layer holds its up and down experts stacked, as many as expert_count."""
    for layer in layers:
        for name in (f"blk.{layer}.ffn_up_exps.weight", f"blk.{layer}.ffn_down_exps.weight"):
            if name not in tensors:
                raise UserError(f"GGUF nemotron_h_moe file lacks {name} (layer {layer} routes to experts)")
            held = tensors[name].data.shape[0]
            if held != n_experts:
                raise UserError(f"GGUF tensor {name} holds {held} experts, the metadata says {n_experts}")


def without_prediction_layers(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """The appended multi-token-prediction layers (past num_hidden_layers) and the RoPE
    factors (in the config now) are no tensors of the model."""
    match = LAYER_OF.match(name)
    if name == "rope_freqs.weight" or (match and int(match.group(1)) >= config["num_hidden_layers"]):
        return {}
    return {name: data}


LAYER_OF = re.compile(r"(?:blk|model\.layers)\.(\d+)\.")


def standalone(model_type: str, hf_architecture: str, names, config, restore=None) -> dict:
    """A row whose config reader builds the family's whole config (no llama-shaped keys)."""
    return dict(model_type=model_type, hf_architecture=hf_architecture, names=names, config=config,
                restore=restore, standalone=True)


MORE_FAMILY_ARCHITECTURES = {
    "gpt-oss": dict(model_type="gpt_oss", hf_architecture="GptOssForCausalLM", names=GPT_OSS_NAMES,
                    config=gpt_oss_keys, restore=restore_gpt_oss),
    "gpt2": standalone("gpt2", "GPT2LMHeadModel", GPT2_NAMES, gpt2_keys, restore=as_written),
    "starcoder": standalone("gpt_bigcode", "GPTBigCodeForCausalLM", STARCODER_NAMES, starcoder_keys,
                            restore=as_written),
    "gptj": standalone("gptj", "GPTJForCausalLM", GPTJ_NAMES, gptj_keys),
    "phimoe": dict(model_type="phimoe", hf_architecture="PhimoeForCausalLM", names=PHIMOE_NAMES, config=phimoe_keys),
    "exaone": dict(model_type="exaone", hf_architecture="ExaoneForCausalLM", names=EXAONE_NAMES, config=exaone_keys,
                   restore=drop_rope_freqs),
    "exaone-moe": dict(model_type="exaone_moe", hf_architecture="ExaoneMoeForCausalLM", names=EXAONE_MOE_NAMES,
                       config=exaone_moe_keys, restore=without_prediction_layers),
    "dots1": dict(model_type="dots1", hf_architecture="Dots1ForCausalLM", names=DOTS1_NAMES, config=dots1_keys),
    "mistral3": dict(model_type="ministral3", hf_architecture="Ministral3ForCausalLM", config=mistral3_keys,
                     permuted_qk=True),
    "nemotron_h_moe": {**standalone("nemotron_h", "NemotronHForCausalLM", NEMOTRON_H_MOE_NAMES, nemotron_h_moe_keys,
                                    restore=restore_nemotron_h), "own_expert_check": True},
    "kimi-linear": dict(model_type="kimi_linear", hf_architecture="KimiLinearForCausalLM", names=KIMI_LINEAR_NAMES,
                        config=kimi_linear_keys, restore=restore_kimi_linear),
    "hunyuan-moe": dict(model_type="hunyuan_v1_moe", hf_architecture="HunYuanMoEV1ForCausalLM",
                        names=HUNYUAN_MOE_NAMES, config=hunyuan_moe_keys),
}
