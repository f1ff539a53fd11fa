"""llama.cpp's GGUF files of gptneox, cohere2, llama4 (mlx_tfm/convert/gguf_families.py):
a tiny transformers model written as llama.cpp's converter (conversion/*.py) writes it,
its TextModel.set_gguf_parameters keys, the family's own and its modify_tensors, names from
gguf's own TensorNameMap, converts to transformers' logits. What a file cannot say
(Cohere 2's period of global layers, Llama 4's chunk size and temperature floor) the
transformers model is given as llama.cpp's runtime fixes it."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import (
    greedy,
    half_split_to_interleaved,
    hf_greedy,
    hf_logits,
    make_hf_model,
)
from fixtures.gguf_names import byte_tokens

import mlx_tfm
from mlx_tfm.convert.converter import convert
from mlx_tfm.convert.gguf_families import llama3_rope_from_factors
from mlx_tfm.errors import UserError
from mlx_tfm.loading import load_model

IDS = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 120, 45]
QUIET = dict(log=lambda *_: None)


def rope_parameters(config: dict) -> dict:
    rope = config.get("rope_parameters") or {}
    return rope.get("full_attention", rope)


def text_model_hparams(writer, config: dict) -> None:
    """TextModel.set_gguf_parameters: the keys every family's file starts from."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    if config.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(config["num_key_value_heads"])
    rope = rope_parameters(config)
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    for key, add in (("rms_norm_eps", writer.add_layer_norm_rms_eps), ("layer_norm_eps", writer.add_layer_norm_eps)):
        if config.get(key) is not None:
            add(config[key])
    for keys, add in ((("num_local_experts", "num_experts"), writer.add_expert_count),
                      (("num_experts_per_tok", "top_k_experts"), writer.add_expert_used_count)):
        value = next((config[k] for k in keys if config.get(k) is not None), None)
        if value is not None:
            add(value)
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def gptneox_hparams(writer, config: dict) -> None:
    """GPTNeoXModel.set_gguf_parameters (it writes no TextModel keys, no KV heads, no base)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(int(rope_parameters(config)["partial_rotary_factor"] * head_dim))
    writer.add_head_count(config["num_attention_heads"])
    writer.add_parallel_residual(config.get("use_parallel_residual", True))
    writer.add_layer_norm_eps(config["layer_norm_eps"])


def cohere2_hparams(writer, config: dict) -> None:
    import gguf

    text_model_hparams(writer, config)
    writer.add_logit_scale(config["logit_scale"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)  # Cohere 2 rotates whole heads
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def llama_hparams(writer, config: dict) -> None:
    """LlamaModel.set_gguf_parameters: the vocabulary size and the rotated dims."""
    text_model_hparams(writer, config)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def llama4_hparams(writer, config: dict) -> None:
    """Llama4Model: the dense MLP's width as the feed-forward length, the experts' apart."""
    llama_hparams(writer, {**config, "intermediate_size": config["intermediate_size_mlp"]})
    writer.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])


def llama3_rope_factors(config: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the per-frequency factors of llama3 RoPE scaling."""
    rope = rope_parameters(config)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / rope["low_freq_factor"], old_context / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def gptneox_tensors(name: str, w: np.ndarray, config: dict):
    """GPTNeoXModel.modify_tensors: query_key_value's rows, (heads, 3, head_dim), regrouped
    as all queries, all keys, all values."""
    if ".attention.query_key_value." in name:
        heads = config["num_attention_heads"]
        grouped = w.reshape(heads, 3, -1, *w.shape[1:])  # (heads, 3, head_dim[, D])
        w = np.concatenate([grouped[:, i].reshape(-1, *w.shape[1:]) for i in range(3)])
    yield name, w


def cohere2_tensors(name: str, w: np.ndarray, config: dict):
    """Cohere2Model.modify_tensors: the (zero) biases are skipped."""
    if name.endswith(".bias"):
        assert not w.any(), name
        return
    yield name, w


def llama4_tensors(name: str, w: np.ndarray, config: dict):
    """Llama4Model.modify_tensors: gate_up_proj (experts, D, 2F) split into gate and up,
    each transposed to (experts, F, D); down_proj (experts, F, D) transposed."""
    if name.endswith("gate_up_proj"):
        gate, up = np.split(np.swapaxes(w, -1, -2), 2, axis=-2)
        yield name.replace("gate_up_proj", "gate_proj.weight"), gate
        yield name.replace("gate_up_proj", "up_proj.weight"), up
        return
    if name.endswith("down_proj"):
        yield name + ".weight", np.swapaxes(w, -1, -2)
        return
    yield name, w


def gemma4_full_layer_shape(config: dict) -> tuple[int, int | None]:
    """Gemma4Model's head size and KV heads of the full layers: global_head_dim /
    num_global_key_value_heads, else the first full layer's per_layer_config."""
    head_dim, kv_heads = config.get("global_head_dim"), config.get("num_global_key_value_heads")
    for layer, overrides in (config.get("per_layer_config") or {}).items():
        if config["layer_types"][int(layer)] == "full_attention":
            head_dim = head_dim or overrides.get("head_dim")
            kv_heads = kv_heads or overrides.get("num_key_value_heads")
    return head_dim, kv_heads


def gemma4_hparams(writer, config: dict) -> None:
    """Gemma3Model.set_gguf_parameters, then Gemma4Model's: the head sizes of both layer
    kinds, which layers slide, KV sharing, per-layer inputs, the widths per layer."""
    text_model_hparams(writer, {**config, "head_dim": None})  # key lengths written below
    rope = config["rope_parameters"]
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_shared_kv_layers(config["num_kv_shared_layers"])
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    sliding = [t == "sliding_attention" for t in config["layer_types"]]
    writer.add_sliding_window_pattern(sliding)
    head_dim_full, _ = gemma4_full_layer_shape(config)
    for add in (writer.add_key_length, writer.add_value_length):
        add(head_dim_full)
    for add in (writer.add_key_length_swa, writer.add_value_length_swa):
        add(config["head_dim"])
    writer.add_rope_dimension_count(head_dim_full)
    writer.add_rope_dimension_count_swa(config["head_dim"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    gemma4_per_layer_hparams(writer, config)  # overwriting TextModel's single values


def gemma4_per_layer_hparams(writer, config: dict) -> None:
    """What Gemma4Model writes per layer (as the converter, overwriting TextModel's keys)."""
    n_layers, n_shared = config["num_hidden_layers"], config["num_kv_shared_layers"]
    if config.get("use_double_wide_mlp"):
        ff = config["intermediate_size"]
        writer.add_feed_forward_length([ff if i < n_layers - n_shared else 2 * ff for i in range(n_layers)])
    _, kv_heads_full = gemma4_full_layer_shape(config)
    if kv_heads_full is not None:
        kv = config["num_key_value_heads"]
        writer.add_head_count_kv([kv if t == "sliding_attention" else kv_heads_full for t in config["layer_types"]])


def gemma4_tensors(name: str, w: np.ndarray, config: dict):
    """Gemma4Model.filter_tensors: layer_scalar and the experts gain a .weight (its norms
    keep their w); modify_tensors names the router's scales after ffn_gate_inp and ffn_down_exps."""
    layer = name.split(".")[2] if ".layers." in name else None
    if name.endswith("router.scale"):
        yield f"blk.{layer}.ffn_gate_inp.scale", w
    elif name.endswith("router.per_expert_scale"):
        yield f"blk.{layer}.ffn_down_exps.scale", w
    else:
        yield (name + ".weight" if name.endswith(("layer_scalar", "gate_up_proj", "experts.down_proj")) else name), w


def gemma4_rope_factors(config: dict) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: 1 for the full layers' rotated pairs, 1e30 for
    the rest ("proportional" RoPE)."""
    head_dim, _ = gemma4_full_layer_shape(config)
    rotated = int(head_dim * config["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [1e30] * (head_dim // 2 - rotated), dtype=np.float32)


def apertus_tensors(name: str, w: np.ndarray, config: dict):
    """ApertusModel.modify_tensors: the xIELU parameters leave the tensors (apertus_extras)."""
    if ".act_fn." not in name:
        yield name, w


def permuted_qk(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """LlamaModel.permute: q/k rows into llama.cpp's interleaved-RoPE order."""
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
        w = half_split_to_interleaved(w, heads)
    return w


def granite_hparams(writer, config: dict) -> None:
    """GraniteModel (no head_dim) and GraniteMoeModel: the multipliers, the shared MLP."""
    llama_hparams(writer, {**config, "head_dim": None})
    writer.add_attention_scale(config["attention_multiplier"])
    writer.add_embedding_scale(config["embedding_multiplier"])
    writer.add_residual_scale(config["residual_multiplier"])
    writer.add_logit_scale(config["logits_scaling"])
    if config.get("shared_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])


def granitemoe_tensors(name: str, w: np.ndarray, config: dict):
    """GraniteMoeModel.modify_tensors: the experts' and the shared MLP's input_linear split
    into gate and up rows; then LlamaModel's q/k permutation."""
    for fused, gate, up, width in (("block_sparse_moe.input_linear", "ffn_gate_exps", "ffn_up_exps", "intermediate_size"),
                                   ("shared_mlp.input_linear", "ffn_gate_shexp", "ffn_up_shexp",
                                    "shared_intermediate_size")):
        if name.endswith(f"{fused}.weight"):
            layer = name.split(".")[2]
            yield f"blk.{layer}.{gate}.weight", w[..., :config[width], :]
            yield f"blk.{layer}.{up}.weight", w[..., config[width]:, :]
            return
    yield name, permuted_qk(name, w, config)


def ernie4_5_moe_hparams(writer, config: dict) -> None:
    """Ernie4_5MoeModel.set_gguf_parameters (its Ernie4_5Model base writes TextModel's)."""
    text_model_hparams(writer, config)
    writer.add_expert_count(config["moe_num_experts"])
    writer.add_expert_used_count(config["moe_k"])
    writer.add_interleave_moe_layer_step(config["moe_layer_interval"])
    writer.add_leading_dense_block_count(config["moe_layer_start_index"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["moe_num_shared_experts"])
    writer.add_expert_shared_feed_forward_length(config["intermediate_size"] // config["num_key_value_heads"])


def experts_apart_tensors(name: str, w: np.ndarray, config: dict):
    """Ernie4_5MoeModel / Qwen2MoeModel / MiniMaxM2Model.modify_tensors stack each layer's
    experts (stacked_experts); ModelBase.filter_tensors names the choice bias a bias."""
    if ".experts." not in name:
        yield name.replace("e_score_correction_bias", "e_score_correction.bias"), w


def stacked_experts(arch, n_experts_key: str, block: str = "mlp", projections=("gate_proj", "up_proj", "down_proj")):
    """Each projection's experts stacked (experts, out, in) under the merged name."""

    def extras(writer, config: dict, weights: dict) -> None:
        import gguf

        names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), config["num_hidden_layers"])
        for layer in range(config["num_hidden_layers"]):
            for projection in projections:
                experts = [weights.get(f"model.layers.{layer}.{block}.experts.{e}.{projection}.weight")
                           for e in range(config[n_experts_key])]
                if experts[0] is not None:
                    merged = names.get_name(f"model.layers.{layer}.{block}.experts.{projection}.weight",
                                            try_suffixes=(".weight",))
                    writer.add_tensor(merged, np.stack(experts))

    return extras


def qwen2moe_hparams(writer, config: dict) -> None:
    text_model_hparams(writer, config)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def gemma_hparams(writer, config: dict) -> None:
    """GemmaModel / Gemma2Model.set_gguf_parameters: no RoPE base (llama.cpp's 10000)."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if config["model_type"] == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])


def gemma_tensors(name: str, w: np.ndarray, config: dict):
    """GemmaModel / Gemma2Model: the (tied) head left out, every norm stored as 1 + w."""
    if name != "lm_head.weight":
        yield name, w + 1 if name.endswith("norm.weight") else w


def command_r_hparams(writer, config: dict) -> None:
    """CommandR2Model: the logit scale, no RoPE scaling."""
    text_model_hparams(writer, config)
    writer.add_logit_scale(config["logit_scale"])


def olmoe_hparams(writer, config: dict) -> None:
    """OlmoeModel: TextModel's keys, the RMS eps overwritten with 1e-5."""
    text_model_hparams(writer, config)
    writer.add_layer_norm_rms_eps(1e-5)


def arcee_tensors(name: str, w: np.ndarray, config: dict):
    """ArceeModel is a LlamaModel: q/k rows permuted."""
    yield name, permuted_qk(name, w, config)


def phi3_hparams(writer, config: dict) -> None:
    """Phi3MiniModel.set_gguf_parameters: the rotated dims, a sliding window of 0 for none."""
    n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
    rope = rope_parameters(config)
    writer.add_context_length(config["max_position_embeddings"])
    if rope.get("original_max_position_embeddings"):
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.get("sliding_window") or 0)


def unchanged_tensors(name: str, w: np.ndarray, config: dict):
    yield name, w


def exaone4_hparams(writer, config: dict) -> None:
    """Exaone4Model: the window and, with it, which layers slide (an LLLG pattern or period)."""
    text_model_hparams(writer, config)
    writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])


def glm4moe_hparams(writer, config: dict) -> None:
    """Glm4MoeModel.set_gguf_parameters: half of each head rotated, sigmoid routing."""
    import gguf

    text_model_hparams(writer, config)
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_rope_dimension_count(int(config["head_dim"] * rope_parameters(config).get("partial_rotary_factor", 0.5)))
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])


def stablelm_hparams(writer, config: dict) -> None:
    """StableLMModel.set_gguf_parameters."""
    n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(int(rope_parameters(config)["partial_rotary_factor"] * (n_embd // n_head)))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_parallel_residual(config.get("use_parallel_residual", True))
    writer.add_layer_norm_eps(config["layer_norm_eps"])


def minimax_m2_hparams(writer, config: dict) -> None:
    """MiniMaxM2Model: the experts' width, the rotated dims (hub configs' rotary_dim)."""
    text_model_hparams(writer, config)
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(int(config["head_dim"] * rope_parameters(config)["partial_rotary_factor"]))


def llama_extras(writer, config: dict, weights: dict) -> None:
    """LlamaModel.generate_extra_tensors: llama3 RoPE scaling as per-frequency factors."""
    if rope_parameters(config).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))


def apertus_extras(writer, config: dict, weights: dict) -> None:
    """ApertusModel.modify_tensors: each layer's xIELU parameters as one metadata list each."""
    llama_extras(writer, config, weights)
    layers = range(config["num_hidden_layers"])
    for parameter, add in (("alpha_n", writer.add_xielu_alpha_n), ("alpha_p", writer.add_xielu_alpha_p),
                           ("beta", writer.add_xielu_beta), ("eps", writer.add_xielu_eps)):
        add([float(weights[f"model.layers.{i}.mlp.act_fn.{parameter}"].reshape(-1)[0]) for i in layers])


def gemma4_extras(writer, config: dict, weights: dict) -> None:
    writer.add_tensor("rope_freqs.weight", gemma4_rope_factors(config))


def no_extras(writer, config: dict, weights: dict) -> None:
    pass


# llama.cpp architecture -> (hparams writer, modify_tensors, extra tensors and keys)
CONVERTERS = {
    "gptneox": (gptneox_hparams, gptneox_tensors, no_extras),
    "cohere2": (cohere2_hparams, cohere2_tensors, no_extras),
    "llama4": (llama4_hparams, llama4_tensors, llama_extras),
    "gemma4": (gemma4_hparams, gemma4_tensors, gemma4_extras),
    "apertus": (llama_hparams, apertus_tensors, apertus_extras),
    "granitemoe": (granite_hparams, granitemoe_tensors, no_extras),
    "gemma": (gemma_hparams, gemma_tensors, no_extras),
    "command-r": (command_r_hparams, cohere2_tensors, no_extras),
    "olmoe": (olmoe_hparams, experts_apart_tensors, stacked_experts("OLMOE", "num_experts")),
    "arcee": (llama_hparams, arcee_tensors, llama_extras),
    "phi3": (phi3_hparams, unchanged_tensors, no_extras),
    "seed_oss": (text_model_hparams, unchanged_tensors, no_extras),
    "exaone4": (exaone4_hparams, unchanged_tensors, llama_extras),
    "stablelm": (stablelm_hparams, unchanged_tensors, no_extras),
    "minimax-m2": (minimax_m2_hparams, experts_apart_tensors,
                   stacked_experts("MINIMAXM2", "num_local_experts", "block_sparse_moe", ("w1", "w2", "w3"))),
    "glm4moe": (glm4moe_hparams, experts_apart_tensors, stacked_experts("GLM4_MOE", "n_routed_experts")),
    "gemma2": (gemma_hparams, gemma_tensors, no_extras),
    "ernie4_5-moe": (ernie4_5_moe_hparams, experts_apart_tensors, stacked_experts("ERNIE4_5_MOE", "moe_num_experts")),
    "qwen2moe": (qwen2moe_hparams, experts_apart_tensors, stacked_experts("QWEN2MOE", "num_experts")),
}


def byte_vocab(writer) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_family_gguf(hf_folder, path, arch_name: str, add_tokenizer=byte_vocab, matrix_type: str = "F32") -> None:
    """``matrix_type`` Q8_0: matrices and stacked experts whose rows fit its blocks as Q8_0."""
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    hparams, modify_tensors, extras = CONVERTERS[arch_name]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    writer = gguf.GGUFWriter(str(path), arch_name)
    hparams(writer, config)
    add_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    weights = {name: np.array(t, dtype=np.float32) for name, t in mx.load(str(hf_folder / "model.safetensors")).items()}
    for name, w in weights.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        for hf, written in modify_tensors(name, w, config):
            llama_cpp = hf if hf.startswith("blk.") else names.get_name(hf, try_suffixes=(".weight", ".bias"))
            written = np.ascontiguousarray(written)
            if matrix_type != "F32" and written.ndim in (2, 3) and written.shape[-1] % 32 == 0:
                qtype = gguf.GGMLQuantizationType[matrix_type]
                writer.add_tensor(llama_cpp, gguf.quants.quantize(written, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(llama_cpp, written)
    extras(writer, config, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# (TINY_CONFIGS case, llama.cpp architecture, overrides: what llama.cpp's runtime fixes)
CASES = {
    "gpt_neox": ("gpt_neox", "gptneox", {}),
    "gpt_neox_sequential": ("gpt_neox_sequential", "gptneox", {}),
    # window 6 over 12 tokens; llama.cpp makes every 4th layer global (layer 3 here)
    "cohere2": ("cohere2", "cohere2", {"sliding_window_pattern": 4, "layer_types": None}),
    # llama.cpp's chunks of 8192, temperature floor 8192 and scale 0.1; every 4th layer
    # unrotated and global, experts on layers 1 and 3 beside the dense MLP of 0 and 2
    "llama4_text": ("llama4_text", "llama4", {"attention_chunk_size": 8192, "no_rope_layer_interval": 4,
                                              "floor_scale": 8192, "attn_scale": 0.1}),
    # per-layer inputs, the last two layers sharing keys and values, full layers with a
    # head twice as large rotating 1/4 of it, window 6
    "gemma4_text": ("gemma4_text", "gemma4", {}),
    # keys as values with one KV head on the full layers, double-wide FFN on shared layers
    "gemma4_text_k_eq_v": ("gemma4_text_k_eq_v", "gemma4", {}),
    # routed experts beside each dense FFN (2 of 4), the router's scales
    "gemma4_text_moe": ("gemma4_text_moe", "gemma4", {}),
    # xIELU per layer, q/k norms, llama3 RoPE scaling (as rope_freqs)
    "apertus": ("apertus", "apertus", {}),
    # Granite's multipliers, 2 of 4 experts by their softmaxed logits (and beside a shared MLP)
    "granitemoe": ("granitemoe", "granitemoe", {}),
    "granitemoeshared": ("granitemoeshared", "granitemoe", {}),
    # layer 0 dense; llama.cpp's experts run to the last layer (no end index in the file)
    "ernie4_5_moe": ("ernie4_5_moe", "ernie4_5-moe", {"moe_layer_end_index": 2}),
    "gemma": ("gemma", "gemma", {}),
    # 2 of 4 experts, unnormalised, beside a gated shared expert
    "qwen2_moe": ("qwen2_moe", "qwen2moe", {}),
    "cohere": ("cohere", "command-r", {}),
    "olmoe": ("olmoe", "olmoe", {}),
    "arcee": ("arcee", "arcee", {}),
    "phi3": ("phi3", "phi3", {}),
    "seed_oss": ("seed_oss", "seed_oss", {}),
    # a quarter of each head rotated, qkv biases; and the parallel block
    "stablelm": ("stablelm", "stablelm", {}),
    "stablelm_parallel": ("stablelm_parallel", "stablelm", {}),
    # sigmoid choice plus a learned bias, q/k norm over all heads, half of each head rotated
    "minimax_m2": ("minimax_m2", "minimax-m2", {}),
    # sigmoid routing within the best of 2 groups, a shared expert, layer 0 dense
    "glm4_moe": ("glm4_moe", "glm4moe", {}),
    # window 6 on layers 0 and 2 (which rotate), layers 1 and 3 global without positions
    # (eos moved: this model's greedy pick is token 2, which generate() with min_new_tokens suppresses)
    "exaone4": ("exaone4", "exaone4", {"eos_token_id": 255}),
    # llama.cpp scales scores by 1/sqrt(head_dim) (query_pre_attn_scalar is no key); window 6
    "gemma2": ("gemma2", "gemma2", {"query_pre_attn_scalar": 16}),
}


@pytest.mark.parametrize("name", CASES)
def test_family_gguf_matches_transformers(name, tmp_path):
    case, arch_name, overrides = CASES[name]
    hf = make_hf_model(case, tmp_path / "hf", **overrides)
    write_family_gguf(tmp_path / "hf", tmp_path / "model.gguf", arch_name)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    model, _ = load_model(tmp_path / "out")
    ours = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    np.testing.assert_allclose(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)
    model, _ = mlx_tfm.load(tmp_path / "out")
    assert greedy(model, IDS, 8) == hf_greedy(hf, IDS, 8)


def llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    return llama3_rope_factors({"rope_parameters": rope, "head_dim": head_dim})


@pytest.mark.parametrize("rope", [
    # several smoothed factors; one; none (the scaled and unscaled frequencies side by side)
    {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 1.5,
     "original_max_position_embeddings": 64},
    {"rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0001,
     "original_max_position_embeddings": 100},
])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_llama3_rope_solved_from_factors_gives_them_back(rope, head_dim):
    """The parameters solved from llama.cpp's rope_freqs give the same factors, whether the
    factors hold several smoothed values, one or none."""
    factors = llama3_factors(rope, head_dim)
    solved = llama3_rope_from_factors(factors.astype(np.float64), rope["rope_theta"], head_dim)
    again = llama3_factors({**solved, "rope_theta": rope["rope_theta"]}, head_dim)
    np.testing.assert_allclose(again, factors, rtol=1e-6)
    assert solved["factor"] == pytest.approx(rope["factor"])


def test_llama3_rope_of_unit_factors_is_none():
    assert llama3_rope_from_factors(np.ones(8), 10000.0, 16) is None


def test_apertus_gguf_without_xielu_metadata_is_one_line(tmp_path):
    make_hf_model("apertus", tmp_path / "hf")
    real = CONVERTERS["apertus"]
    CONVERTERS["apertus"] = (real[0], real[1], llama_extras)  # the xIELU lists left out
    try:
        write_family_gguf(tmp_path / "hf", tmp_path / "model.gguf", "apertus")
    finally:
        CONVERTERS["apertus"] = real
    with pytest.raises(UserError, match=r"GGUF apertus metadata lacks xielu\.alpha_p \(one value per layer\)") as error:
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert "\n" not in str(error.value)


# -- Gemma 4's vocabulary (tokenizer model "gemma4") ----------------------------------------

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # ids 0-4, as Gemma's


def gemma4_style_bpe(lines: list[str]) -> tuple[dict, list[str]]:
    """A SentencePiece-style BPE trained here as Gemma 4's is shaped: spaces as "▁", merges
    within newline-free runs, every byte as a <0xNN> piece for byte fallback."""
    from tokenizers import (
        Regex,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), "isolated")
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=GEMMA_SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(["\n".join(lines[i:i + 4]) for i in range(0, len(lines), 4)], trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return vocab, merges


def gemma4_vocab_writer(vocab: dict, merges: list[str]):
    """Gemma4Model.set_vocab: LlamaHfVocab's pieces and types, the merges, no space prefix."""
    def add_tokenizer(writer):
        tokens = sorted(vocab, key=vocab.get)
        kinds = [3 if t in GEMMA_SPECIALS and t != "<unk>" else 2 if t == "<unk>" else
                 6 if t.startswith("<0x") and len(t) == 6 else 1 for t in tokens]
        writer.add_tokenizer_model("gemma4")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types(kinds)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_space_prefix(False)
        writer.add_add_bos_token(True)
    return add_tokenizer


def test_gemma4_vocabulary_tokenizes_as_gemmas_tokenizer(tmp_path):
    """A Gemma 4 GGUF's tokenizer (model "gemma4") splits text as transformers' Gemma
    tokenizer over the same pieces and merges: "▁" for spaces, bytes for what the pieces
    lack (the emoji), the BOS token first."""
    from conftest import data_path
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    lines = data_path("tinyshakespeare", "input.txt").read_text().splitlines()
    vocab, merges = gemma4_style_bpe(lines[:4000])
    make_hf_model("gemma4_text", tmp_path / "hf", vocab_size=len(vocab), vocab_size_per_layer_input=len(vocab))
    write_family_gguf(tmp_path / "hf", tmp_path / "model.gguf", "gemma4", add_tokenizer=gemma4_vocab_writer(vocab, merges))
    _, tokenizer = mlx_tfm.load(tmp_path / "model.gguf")
    reference = GemmaTokenizer(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    text = "\n".join(lines[5000:5030]) + "\n\n  Two  spaces, 12345 naïve 🦙 end.\n"
    ours = tokenizer.encode(text, add_special_tokens=False)
    assert ours == reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode("Hello", add_special_tokens=True)[0] == 2
    assert tokenizer.decode(ours) == text


def test_glm4moe_gguf_multi_token_prediction_layer_is_dropped(tmp_path):
    """Glm4MoeModel appends the MTP layers (block_count counts them, nextn_predict_layers
    says how many): they are no part of the model, which gives transformers' logits."""
    hf = make_hf_model("glm4_moe", tmp_path / "hf")
    hparams, tensors, extras = CONVERTERS["glm4moe"]

    def with_mtp_layer(writer, config, weights):
        extras(writer, config, weights)
        writer.add_block_count(config["num_hidden_layers"] + 1)
        writer.add_nextn_predict_layers(1)
        for name in ("attn_norm.weight", "nextn.eh_proj.weight", "nextn.enorm.weight"):
            writer.add_tensor(f"blk.2.{name}", np.ones((64, 128) if "eh_proj" in name else (64,), np.float32))

    CONVERTERS["glm4moe"] = (hparams, tensors, with_mtp_layer)
    try:
        write_family_gguf(tmp_path / "hf", tmp_path / "model.gguf", "glm4moe")
    finally:
        CONVERTERS["glm4moe"] = (hparams, tensors, extras)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 2
    model, _ = load_model(tmp_path / "out")
    np.testing.assert_allclose(np.array(model(mx.array([IDS]))[0]), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def dequantized_copy(source, path, arch_name: str) -> None:
    """The same GGUF file with every tensor decoded to float32 by gguf's own decoder."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), arch_name)
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", ["gpt_neox", "llama4_text", "gemma4_text"])
def test_family_gguf_q8_0_blocks(name, tmp_path):
    """Q8_0 matrices (fused qkv rows split, stacked experts, Gemma 4's renamed tensors) are
    carried over as 8-bit groups that compute what the file's values decoded by gguf give."""
    case, arch_name, overrides = CASES[name]
    make_hf_model(case, tmp_path / "hf", **overrides)
    write_family_gguf(tmp_path / "hf", tmp_path / "q8.gguf", arch_name, matrix_type="Q8_0")
    dequantized_copy(tmp_path / "q8.gguf", tmp_path / "f32.gguf", arch_name)
    logits = {}
    for kind in ("q8", "f32"):
        convert(tmp_path / f"{kind}.gguf", tmp_path / kind, dtype="float32", **QUIET)
        model, _ = load_model(tmp_path / kind)
        logits[kind] = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]["bits"] == 8
    np.testing.assert_allclose(logits["q8"], logits["f32"], atol=1e-4, rtol=0)
