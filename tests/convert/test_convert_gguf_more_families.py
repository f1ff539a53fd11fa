"""llama.cpp's GGUF files of gpt-oss, gpt2, starcoder, gptj, ... (mlx_tfm/convert/
gguf_more_families.py): a tiny transformers model written as llama.cpp's converter
(conversion/*.py) writes it, the family's set_gguf_parameters keys and modify_tensors,
names from gguf's own TensorNameMap, converts to transformers' logits and greedy tokens."""

import json
import re

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
from mlx_tfm.errors import UserError
from mlx_tfm.loading import load_model

IDS = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 120, 45]
QUIET = dict(log=lambda *_: None)


def text_model_hparams(writer, config: dict) -> None:
    """TextModel.set_gguf_parameters: the keys most families' files start from."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings") or config["model_max_length"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])


def yarn_hparams(writer, rope: dict) -> None:
    """TextModel's rope scaling keys for YaRN."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def gpt_oss_hparams(writer, config: dict) -> None:
    """GptOssModel.set_gguf_parameters: the window, the experts' width and counts."""
    text_model_hparams(writer, config)
    yarn_hparams(writer, config["rope_parameters"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])


def gpt_oss_tensors(name: str, w: np.ndarray, config: dict):
    """GptOssModel.modify_tensors: gate_up_proj (experts, D, 2F) transposed and split into
    its even (gate) and odd (up) rows, its bias likewise; down_proj transposed; the sinks
    named a weight."""
    layer = name.split(".")[2] if ".layers." in name else None
    if name.endswith("gate_up_proj"):
        rows = np.swapaxes(w, -1, -2)  # (experts, 2F, D)
        yield f"blk.{layer}.ffn_gate_exps.weight", rows[:, ::2]
        yield f"blk.{layer}.ffn_up_exps.weight", rows[:, 1::2]
    elif name.endswith("gate_up_proj_bias"):
        yield f"blk.{layer}.ffn_gate_exps.bias", w[..., ::2]
        yield f"blk.{layer}.ffn_up_exps.bias", w[..., 1::2]
    elif name.endswith("down_proj"):
        yield f"blk.{layer}.ffn_down_exps.weight", np.swapaxes(w, -1, -2)
    elif name.endswith("down_proj_bias"):
        yield f"blk.{layer}.ffn_down_exps.bias", w
    else:
        yield (name + ".weight" if name.endswith("sinks") else name), w


def gpt2_hparams(writer, config: dict) -> None:
    """GPT2Model / StarCoderModel / GPTJModel.set_gguf_parameters: 4 x hidden as the
    feed-forward length, whatever the model's is."""
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    if config["model_type"] == "gpt_bigcode":
        writer.add_head_count_kv(1 if config.get("multi_query", True) else config["n_head"])
    if config["model_type"] == "gptj":
        writer.add_head_count_kv(config["n_head"])
        writer.add_rope_dimension_count(config["rotary_dim"])


def gpt2_tensors(name: str, w: np.ndarray, config: dict):
    """GPT2Model.modify_tensors: the Conv1D weights (in, out) transposed."""
    if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        w = w.T
    yield name, w


def unchanged_tensors(name: str, w: np.ndarray, config: dict):
    yield name, w


def phimoe_hparams(writer, config: dict) -> None:
    """PhiMoeModel: Phi3MiniModel's keys (a window of 0 for none), then the expert counts."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    text_model_hparams(writer, {**config, "head_dim": None})
    writer.add_rope_dimension_count(head_dim)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_count(config["num_local_experts"])


def exaone_hparams(writer, config: dict) -> None:
    """ExaoneModel: TextModel's keys and the rotated dims of a head."""
    text_model_hparams(writer, config)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def router_hparams(writer, config: dict) -> None:
    """What Dots1Model and ExaoneMoEModel write of DeepSeek-V3's router."""
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])


def exaone_moe_hparams(writer, config: dict) -> None:
    """ExaoneMoEModel: Exaone4Model's window and sliding layers, the router's keys."""
    import gguf

    text_model_hparams(writer, config)
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    writer.add_expert_count(config["num_experts"])
    router_hparams(writer, config)
    writer.add_expert_shared_count(config["num_shared_experts"])
    writer.add_expert_shared_feed_forward_length(config["moe_intermediate_size"] * config["num_shared_experts"])
    writer.add_nextn_predict_layers(0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def dots1_hparams(writer, config: dict) -> None:
    """Dots1Model: Qwen2MoeModel's keys, then the router's."""
    text_model_hparams(writer, config)
    writer.add_expert_count(config["n_routed_experts"])
    router_hparams(writer, config)
    writer.add_expert_shared_count(config["n_shared_experts"])


def hunyuan_moe_hparams(writer, config: dict) -> None:
    """HunYuanMoEModel: the experts' counts and widths, NTK-alpha folded into the base."""
    import gguf

    text_model_hparams(writer, config)
    rope = config["rope_parameters"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2)))
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["moe_topk"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["intermediate_size"])
    writer.add_expert_shared_count(1)


def mistral3_hparams(writer, config: dict) -> None:
    """Ministral3Model: LlamaModel's keys, YaRN as TextModel writes it, the checkpoint's
    mscale_all_dim as the log multiplier and llama_4_scaling_beta as the temperature scale."""
    rope = config["rope_parameters"]
    text_model_hparams(writer, config)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])
    yarn_hparams(writer, rope)
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def permuted_tensors(name: str, w: np.ndarray, config: dict):
    """LlamaModel.modify_tensors: q/k rows into llama.cpp's interleaved-RoPE order."""
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
        w = half_split_to_interleaved(w, heads)
    yield name, w


def nemotron_h_moe_hparams(writer, config: dict) -> None:
    """NemotronHModel with experts (GraniteHybridModel's keys first): head_count_kv per
    layer, the Mamba-2 widths, no RoPE, the experts' width as the experts layers'
    feed_forward_length (0 elsewhere), the router's keys."""
    kinds = config["layers_block_type"]
    heads, head_dim = config["mamba_num_heads"], config["mamba_head_dim"]
    writer.add_context_length(2**20)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(len(kinds))
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([config["num_key_value_heads"] if k == "full_attention" else 0 for k in kinds])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_ssm_conv_kernel(config["conv_kernel"])
    writer.add_ssm_state_size(config["ssm_state_size"])
    writer.add_ssm_group_count(config["n_groups"])
    writer.add_ssm_inner_size(heads * head_dim)
    writer.add_ssm_time_step_rank(heads)
    writer.add_rope_scaling_finetuned(False)
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_feed_forward_length([config["moe_intermediate_size"] if k == "moe" else 0 for k in kinds])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["moe_shared_expert_intermediate_size"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_group_count(config["n_group"])


def nemotron_h_moe_tensors(name: str, w: np.ndarray, config: dict):
    """NemotronHModel.modify_tensors with experts: conv weights squeezed, A = -exp(A_log)
    and D as (heads, 1), the gated norm per group, dt_bias a dt bias, q/k rows permuted
    (LlamaModel's permute, GraniteHybridModel undoing its own), experts stacked."""
    if name.endswith("conv1d.weight"):
        w = w[:, 0, :]  # (channels, kernel)
    elif name.endswith(".A_log"):
        w = -np.exp(w)[:, None]  # (heads, 1)
    elif name.endswith(".D"):
        w = w[:, None]
    elif name.endswith("mixer.norm.weight"):
        w = w.reshape(config["n_groups"], -1)  # (groups, inner / groups)
    elif name.endswith(("q_proj.weight", "k_proj.weight")):
        w = next(permuted_tensors(name, w, config))[1]
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt.bias")
    yield from experts_stacked(name, w, config)


def kimi_linear_hparams(writer, config: dict) -> None:
    """KimiLinearModel: TextModel's keys, head_count_kv per layer (0 on KDA layers, 1 on
    the MLA ones: MLA as MQA), the KDA widths, the MLA widths, the router's keys."""
    text_model_hparams(writer, {**config, "head_dim": None})
    writer.add_vocab_size(config["vocab_size"])
    writer.add_head_count_kv([1 if t == "full_attention" else 0 for t in config["layer_types"]])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_kda_head_dim(config["linear_head_dim"])
    writer.add_kv_lora_rank(config["kv_lora_rank"])
    writer.add_rope_dimension_count(config["qk_rope_head_dim"])
    writer.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
    writer.add_key_length_mla(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_token"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["num_shared_experts"])
    writer.add_leading_dense_block_count(config["mlp_layer_types"].index("sparse"))
    writer.add_expert_weights_scale(config["routed_scaling_factor"])


def kimi_linear_tensors(name: str, w: np.ndarray, config: dict):
    """KimiLinearModel.modify_tensors: the KDA convolutions (C, 1, K) as (1, C, 1, K),
    A = -exp(A_log), dt_bias a dt bias, kv_b_proj split per head into k_b (H, R, nope) and
    v_b (H, v, R); the dense layer's MLP (the map has no name for it under
    block_sparse_moe) as the dense FFN; experts stacked."""
    layer = name.split(".")[2] if ".layers." in name else None
    dense = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate|up|down)_proj\.weight", name)
    if dense:
        yield f"blk.{dense[1]}.ffn_{dense[2]}.weight", w
        return
    if name.endswith("_conv1d.weight"):
        w = w.reshape(1, w.shape[0], 1, w.shape[-1])
    elif name.endswith(".A_log"):
        w = -np.exp(w)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif name.endswith("kv_b_proj.weight"):
        nope, heads = config["qk_nope_head_dim"], config["num_attention_heads"]
        per_head = w.reshape(heads, -1, w.shape[-1])  # (H, nope + v, R)
        yield f"blk.{layer}.attn_k_b.weight", np.swapaxes(per_head[:, :nope], 1, 2)
        yield f"blk.{layer}.attn_v_b.weight", per_head[:, nope:]
        return
    yield from experts_stacked(name, w, config)


def bert_hparams(writer, config: dict) -> None:
    """BertModel.set_gguf_parameters: TextModel's keys, attention not causal."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)


def bert_tensors(name: str, w: np.ndarray, config: dict):
    """BertModel.filter_tensors: the pooler (and any masked-LM head) dropped."""
    if not name.startswith(("pooler.", "cls.")) and name != "embeddings.position_ids":
        yield name, w


def wordpiece_vocab(folder):
    """BertModel.set_vocab: the WordPiece pieces in phantom spaces (word starts "\u2581x",
    continuations without "##"), the special tokens as control tokens; CLS as BOS."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(folder)
    pieces = sorted(reference.vocab, key=reference.vocab.get)
    control = set(reference.all_special_tokens)

    def add_vocab(writer):
        writer.add_tokenizer_model("bert")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([p if p in control else p[2:] if p.startswith("##") else "\u2581" + p for p in pieces])
        writer.add_token_types([3 if p in control else 1 for p in pieces])
        writer.add_token_type_count(2)
        for add, token in ((writer.add_bos_token_id, "[CLS]"), (writer.add_sep_token_id, "[SEP]"),
                           (writer.add_unk_token_id, "[UNK]"), (writer.add_pad_token_id, "[PAD]"),
                           (writer.add_mask_token_id, "[MASK]")):
            add(reference.vocab[token])

    return add_vocab


EXPERT = re.compile(r"(?:model|backbone)\.layers\.(\d+)\.(?:mlp|block_sparse_moe|mixer)\.experts\.(\d+)\.(\w+)\.weight")
STACKED = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
           "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


def experts_stacked(name: str, w: np.ndarray, config: dict):
    """The MoE converters' modify_tensors: each layer's experts stacked (experts, out, in)
    once the last one is read; the choice bias named exp_probs_b."""
    match = EXPERT.fullmatch(name)
    if match is None:
        if name.endswith("e_score_correction_bias"):
            yield f"blk.{name.split('.')[2]}.exp_probs_b.bias", w
        else:
            yield name, w
        return
    layer, expert, projection = match.groups()
    held = PENDING.setdefault((layer, projection), {})
    held[int(expert)] = w
    n_experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    if len(held) == n_experts:  # the layer's last expert of this projection
        yield f"blk.{layer}.{STACKED[projection]}.weight", np.stack([held[e] for e in range(n_experts)])
        del PENDING[(layer, projection)]


PENDING: dict = {}


# llama.cpp architecture -> (hparams writer, modify_tensors)
CONVERTERS = {
    "gpt-oss": (gpt_oss_hparams, gpt_oss_tensors),
    "gpt2": (gpt2_hparams, gpt2_tensors),
    "starcoder": (gpt2_hparams, unchanged_tensors),
    "gptj": (gpt2_hparams, unchanged_tensors),
    "phimoe": (phimoe_hparams, experts_stacked),
    "exaone": (exaone_hparams, unchanged_tensors),
    "exaone-moe": (exaone_moe_hparams, experts_stacked),
    "dots1": (dots1_hparams, experts_stacked),
    "hunyuan-moe": (hunyuan_moe_hparams, experts_stacked),
    "mistral3": (mistral3_hparams, permuted_tensors),
    "nemotron_h_moe": (nemotron_h_moe_hparams, nemotron_h_moe_tensors),
    "kimi-linear": (kimi_linear_hparams, kimi_linear_tensors),
    "bert": (bert_hparams, bert_tensors),
    "t5": (lambda writer, config: t5_hparams(writer, config), lambda name, w, config: t5_tensors(name, w, config)),
}


def byte_vocab(writer) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(hf_folder, path, arch_name: str, matrix_type: str = "F32", skip=(), more_hparams=None,
               add_vocab=byte_vocab) -> None:
    """The tiny model as llama.cpp's converter writes it; ``matrix_type`` Q8_0: matrices and
    stacked experts whose rows fit its blocks as Q8_0; the tensors named in ``skip`` left
    out, ``more_hparams(writer)`` adding keys (error cases)."""
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    hparams, modify_tensors = CONVERTERS[arch_name]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    writer = gguf.GGUFWriter(str(path), arch_name)
    hparams(writer, config)
    if more_hparams:
        more_hparams(writer)
    add_vocab(writer)
    n_layers = (config.get("num_hidden_layers") or config.get("n_layer") or max(config.get("num_layers", 0), config.get(
        "num_decoder_layers") or 0) or len(config["layers_block_type"]))
    names = gguf.get_tensor_name_map(arch, n_layers)
    weights = {name: np.array(t, dtype=np.float32) for name, t in mx.load(str(hf_folder / "model.safetensors")).items()}
    for name, w in weights.items():
        embedding = next((weights[n] for n in ("model.embed_tokens.weight", "shared.weight") if n in weights), None)
        if name == "lm_head.weight" and config.get("tie_word_embeddings") and np.array_equal(w, embedding):
            continue  # a tied head is the embedding table
        for hf, written in modify_tensors(name, w, config):
            llama_cpp = hf if hf.startswith("blk.") else names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert llama_cpp is not None, hf
            if llama_cpp in skip:
                continue
            written = np.ascontiguousarray(written)
            # llama.cpp quantizes weights only (gpt-oss's expert biases are matrices too)
            if matrix_type != "F32" and written.ndim in (2, 3) and written.shape[-1] % 32 == 0 and hf.endswith("weight"):
                qtype = gguf.GGMLQuantizationType[matrix_type]
                writer.add_tensor(llama_cpp, gguf.quants.quantize(written, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(llama_cpp, written)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# (TINY_CONFIGS case, llama.cpp architecture, overrides: what llama.cpp's runtime fixes)
CASES = {
    # llama.cpp's YaRN truncates the correction range (transformers' truncate true); an
    # original context of 4 the prompt passes
    "gpt_oss": ("gpt_oss", "gpt-oss", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0}}),
    "gpt2": ("gpt2", "gpt2", {}),
    # multi-query, an MLP half of 4 x hidden wide
    "gpt_bigcode": ("gpt_bigcode", "starcoder", {}),
    "gptj": ("gptj", "gptj", {}),
    # sparsemixer routing at transformers' (and Phi-3.5-MoE's) jitter, which no key carries
    "phimoe": ("phimoe", "phimoe", {"router_jitter_noise": 0.01}),
    "exaone": ("exaone", "exaone", {}),
    # llama.cpp's exaone-moe and dots1 route without expert groups (their files write none);
    # its dots1 attends fully on every layer (no window key)
    "exaone_moe": ("exaone_moe", "exaone-moe", {"n_group": 1, "topk_group": 1}),
    "dots1": ("dots1", "dots1", {"n_group": 1, "topk_group": 1, "sliding_window": None, "layer_types": None}),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", "hunyuan-moe", {}),
    # YaRN whose original context (4) the prompt passes: the queries' position scale grows
    "ministral3": ("ministral3", "mistral3", {}),
    # Mamba-2, experts, attention, a dense MLP, experts; one router group (llama.cpp's file
    # writes the group count, not how many are used)
    "nemotron_h_moe": ("nemotron_h_moe", "nemotron_h_moe", {"n_group": 1, "topk_group": 1}),
    # KDA around an MLA layer, layer 0 dense; one router group (the file writes none)
    "kimi_linear": ("kimi_linear", "kimi-linear", {"n_group": 1, "topk_group": 1}),
}


@pytest.mark.parametrize("name", CASES)
def test_more_family_gguf_matches_transformers(name, tmp_path):
    case, arch_name, overrides = CASES[name]
    hf = make_hf_model(case, tmp_path / "hf", **overrides)
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", arch_name)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    model, _ = load_model(tmp_path / "out")
    ours = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    np.testing.assert_allclose(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)
    model, _ = mlx_tfm.load(tmp_path / "out")
    assert greedy(model, IDS, 8) == hf_greedy(hf, IDS, 8)


def test_architecture_this_runtime_cannot_map_is_one_line(tmp_path):
    """llama.cpp's rwkv7 (no family here): a one-line error naming it, no folder written."""
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "rwkv7")
    writer.add_block_count(1)
    byte_vocab(writer)
    writer.add_tensor("token_embd.weight", np.zeros((256, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=r"GGUF architecture 'rwkv7' is not supported \(supported: .*gpt-oss") as error:
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("skip, more_hparams, message", [
    (("blk.1.ffn_up_exps.weight",), None,
     r"GGUF nemotron_h_moe file lacks blk\.1\.ffn_up_exps\.weight \(layer 1 routes to experts\)"),
    ((), lambda writer: writer.add_moe_latent_size(16), r"nemotron_h experts with moe_latent_size .* not supported"),
])
def test_nemotron_h_moe_gguf_errors_are_one_line(skip, more_hparams, message, tmp_path):
    """An experts layer without its experts, and experts inside a latent projection (Nemotron
    3 Super's, which the family lacks), are named."""
    case, arch_name, overrides = CASES["nemotron_h_moe"]
    make_hf_model(case, tmp_path / "hf", **overrides)
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", arch_name, skip=skip, more_hparams=more_hparams)
    with pytest.raises(UserError, match=message) as error:
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert "\n" not in str(error.value)


def test_bert_gguf_matches_transformers(tmp_path):
    """A BERT GGUF (the encoder without pooler, a phantom-space WordPiece vocabulary) gives
    transformers' hidden states over two segments, and its tokenizer splits text as
    transformers' BertTokenizer over the same vocabulary."""
    import torch
    from fixtures.encoder_models import bert_with_tokenizer
    from transformers import AutoTokenizer

    hf = bert_with_tokenizer(tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "bert", add_vocab=wordpiece_vocab(tmp_path / "hf"))
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    model, tokenizer = mlx_tfm.load(tmp_path / "out")
    assert model.args.kind == "encoder" and model.args.head == "none"
    reference = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ("The cat sat on the mat.", "Paris is the capital of France, a red sky?", "unknownword dogs!"):
        assert tokenizer.encode(text) == reference.encode(text), text
    ids = reference.encode("the cat sat on the mat", "paris is the capital of france")
    types = reference("the cat sat on the mat", "paris is the capital of france")["token_type_ids"]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).last_hidden_state.numpy()
    ours = np.array(model(mx.array([ids]), mx.array([types])))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["bert", "t5"])
def test_encoder_gguf_names_are_the_inverse_and_cover_the_model(arch):
    """Writing (gguf_name) undoes reading (hf_name) for every tensor llama.cpp names in a
    bert / t5 file and gives gguf's own TensorNameMap name; every tensor of the tiny
    BertModel / T5ForConditionalGeneration the map names is read."""
    import gguf
    import torch
    from fixtures.encoder_models import TINY_ENCODERS, TINY_T5
    from fixtures.gguf_names import llama_cpp_tensor_names
    from transformers import AutoConfig, AutoModel, T5ForConditionalGeneration

    from mlx_tfm.convert.gguf_file import gguf_name, hf_name

    theirs = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), 4)
    read = {name: hf for name in llama_cpp_tensor_names(arch) if (hf := hf_name(name, arch)) != name}
    for name, hf in read.items():
        assert gguf_name(hf, arch) == name
        assert theirs.get_name(hf, try_suffixes=(".weight", ".bias")) in (None, name), hf
    with torch.device("meta"):
        model = (AutoModel.from_config(AutoConfig.for_model("bert", **TINY_ENCODERS["bert"])) if arch == "bert" else
                 T5ForConditionalGeneration(AutoConfig.for_model("t5", **TINY_T5["relu-tied"][1])))
    named = [theirs.get_name(n, try_suffixes=(".weight", ".bias")) for n in model.state_dict()]
    held = {re.sub(r"^(enc\.|dec\.)?blk\.\d+\.", r"\1blk.1.", n) for n in named if n}
    held = {n if n.endswith((".weight", ".bias")) else n + ".weight" for n in held}
    assert held and not held - set(read), sorted(held - set(read))


def t5_hparams(writer, config: dict) -> None:
    """T5Model.set_gguf_parameters."""
    writer.add_context_length(512)
    writer.add_embedding_length(config["d_model"])
    writer.add_feed_forward_length(config["d_ff"])
    writer.add_block_count(config["num_layers"])
    writer.add_decoder_block_count(config["num_decoder_layers"])
    writer.add_head_count(config["num_heads"])
    writer.add_key_length(config["d_kv"])
    writer.add_value_length(config["d_kv"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_relative_attn_buckets_count(config["relative_attention_num_buckets"])
    writer.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    writer.add_decoder_start_token_id(config["decoder_start_token_id"])


def t5_tensors(name: str, w: np.ndarray, config: dict):
    """T5Model.modify_tensors: one shared embedding table (the stacks' copies left out)."""
    if name not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        yield name, w


def small_byte_vocab(size: int):
    def add_vocab(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(byte_tokens()[:size])
        writer.add_token_types([1] * size)
        writer.add_token_merges([])
        writer.add_eos_token_id(1)
    return add_vocab


@pytest.mark.parametrize("kind", ["relu-tied", "gated-untied"])
def test_t5_gguf_matches_transformers(kind, tmp_path):
    """T5 v1.0 (ReLU, the head tied and rescaled) and v1.1 (gated GELU, its own head) GGUFs
    give transformers' teacher-forced logits, the relative position buckets read from each
    stack's first block (over a prompt longer than the buckets' exact range)."""
    import torch
    from fixtures.encoder_models import random_t5

    # llama.cpp's buckets reach 128 positions; a deeper decoder than encoder
    hf = random_t5(kind, tmp_path / "hf", num_decoder_layers=3, relative_attention_max_distance=128)
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "t5", add_vocab=small_byte_vocab(hf.config.vocab_size))
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    model, _ = load_model(tmp_path / "out")
    ids = np.array([[5, 17, 60, 33, 9, 101, 64, 11, 3, 77, 19, 45, 8, 90, 14, 2, 1]])
    decoder_ids = np.array([[0, 7, 30, 12, 99, 4]])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(decoder_ids)).logits.numpy()
    ours = np.array(model(mx.array(ids), mx.array(decoder_ids)))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def unigram_vocab(folder):
    """T5Model.set_vocab: the SentencePiece unigram model's pieces, scores and types, its
    normalizer's flags and precompiled character map."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((folder / "spiece.model").read_bytes())
    processor = spm.SentencePieceProcessor(model_file=str(folder / "spiece.model"))

    def add_vocab(writer):
        n = processor.vocab_size()
        writer.add_tokenizer_model("t5")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([processor.id_to_piece(i) for i in range(n)])
        writer.add_token_scores([processor.get_score(i) for i in range(n)])
        writer.add_token_types([2 if processor.is_unknown(i) else 3 if processor.is_control(i) else 1 for i in range(n)])
        writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
        writer.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
        writer.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
        writer.add_eos_token_id(processor.eos_id())
        writer.add_unk_token_id(processor.unk_id())
        writer.add_pad_token_id(processor.pad_id())

    return add_vocab, processor


def test_t5_gguf_vocabulary_tokenizes_as_its_sentencepiece_model(tmp_path):
    """A T5 GGUF's unigram vocabulary (tokenizer model "t5") splits text as the
    SentencePiece model it came from, its normalizer (NFKC map, extra spaces) included."""
    from fixtures.encoder_models import T5_TEXTS, random_t5, t5_tokenizer

    t5_tokenizer(tmp_path / "hf", extra_ids=0)
    add_vocab, processor = unigram_vocab(tmp_path / "hf")
    random_t5("relu-tied", tmp_path / "hf", vocab_size=processor.vocab_size())
    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "t5", add_vocab=add_vocab)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    _, tokenizer = mlx_tfm.load(tmp_path / "out")
    for text in [*T5_TEXTS, "  the   cat\u00a0sat ① on ﬁne mats  "]:
        assert tokenizer.encode(text, add_special_tokens=False) == processor.encode(text), text


def test_phimoe_gguf_with_longrope_factors_is_one_line(tmp_path):
    """Phi-3.5-MoE's own files carry LongRoPE factors (Phi3MiniModel.generate_extra_tensors),
    which this runtime cannot scale by: named, not a wrong model."""
    case, arch_name, overrides = CASES["phimoe"]
    make_hf_model(case, tmp_path / "hf", **overrides)
    head_dim = 64 // 4

    def factors(writer):
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.ones(head_dim // 2, np.float32))

    write_gguf(tmp_path / "hf", tmp_path / "model.gguf", arch_name, more_hparams=factors)
    with pytest.raises(UserError, match=r"GGUF phimoe with LongRoPE factors .* not supported") as error:
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert "\n" not in str(error.value)


def test_gpt_oss_gguf_mxfp4_experts_decode_as_gguf_decodes_them(tmp_path):
    """gpt-oss files hold their experts in MXFP4 blocks (GptOssModel.repack_mxfp4): decoded
    to float, they compute what the file's values decoded by gguf give."""
    case, arch_name, overrides = CASES["gpt_oss"]
    make_hf_model(case, tmp_path / "hf", **overrides)
    write_gguf(tmp_path / "hf", tmp_path / "mxfp4.gguf", arch_name, matrix_type="MXFP4")
    dequantized_copy(tmp_path / "mxfp4.gguf", tmp_path / "f32.gguf", arch_name)
    logits = {}
    for kind in ("mxfp4", "f32"):
        convert(tmp_path / f"{kind}.gguf", tmp_path / kind, dtype="float32", **QUIET)
        model, _ = load_model(tmp_path / kind)
        logits[kind] = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    np.testing.assert_allclose(logits["mxfp4"], logits["f32"], atol=1e-4, rtol=0)


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


@pytest.mark.parametrize("name", ["gpt_oss", "gpt2", "dots1"])
def test_more_family_gguf_q8_0_blocks(name, tmp_path):
    """Q8_0 matrices (gpt-oss's split experts, GPT-2's fused qkv in mlx-lm's layout, dots1's
    stacked and shared experts) are carried over as 8-bit groups that compute what the
    file's values decoded by gguf give."""
    case, arch_name, overrides = CASES[name]
    make_hf_model(case, tmp_path / "hf", **overrides)
    write_gguf(tmp_path / "hf", tmp_path / "q8.gguf", arch_name, matrix_type="Q8_0")
    dequantized_copy(tmp_path / "q8.gguf", tmp_path / "f32.gguf", arch_name)
    logits = {}
    for kind in ("q8", "f32"):
        convert(tmp_path / f"{kind}.gguf", tmp_path / kind, dtype="float32", **QUIET)
        model, _ = load_model(tmp_path / kind)
        logits[kind] = np.array(model(mx.array([IDS]))[0].astype(mx.float32))
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"]["bits"] == 8
    np.testing.assert_allclose(logits["q8"], logits["f32"], atol=1e-4, rtol=0)
