"""llama.cpp's deepseek2 GGUF files (DeepSeek-V2/V3, Kimi K2, Moonlight) -> our MLA
families: a tiny transformers model written as llama.cpp's converter writes it (gguf's
own name map, stacked experts, kv_b_proj whole or split per head into attn_k_b /
attn_v_b, the MLA metadata keys) converts to the same logits."""

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import hf_logits, make_hf_model
from fixtures.gguf_names import byte_tokens

from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

IDS = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 120, 45]
QUIET = dict(log=lambda *_: None)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def add_hparams(writer, config: dict) -> None:
    """DeepseekV2Model.set_gguf_parameters as llama.cpp's converter writes it (the newer
    MLA layout: one KV head, key_length the cached latent's, the head widths in *_mla)."""
    import gguf

    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(config["kv_lora_rank"])
    writer.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
    writer.add_value_length(config["kv_lora_rank"])
    writer.add_key_length_mla(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_rope_dimension_count(config["qk_rope_head_dim"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    sigmoid = config["model_type"] == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_group_count(config.get("n_group") or 1)
    writer.add_expert_group_used_count(config.get("topk_group") or 1)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def llama_cpp_tensors(config: dict, weights: dict, split_kv_b: bool) -> dict[str, np.ndarray]:
    """The checkpoint in llama.cpp's names (gguf's TensorNameMap) and layout: experts
    stacked (experts, out, in); the router's bias as ``exp_probs_b.bias``; kv_b_proj
    whole, or per head (k_b (H, R, nope), v_b (H, v, R)) as newer converters write it."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config["num_hidden_layers"])
    H, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    tensors, experts = {}, {}
    for name, w in weights.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = w
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if split_kv_b and name.endswith("kv_b_proj.weight"):
            per_head = w.reshape(H, -1, w.shape[-1])  # (H, nope + v, R)
            tensors[names.get_name(name.replace("kv_b", "k_b"), try_suffixes=(".weight",))] = \
                np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            tensors[names.get_name(name.replace("kv_b", "v_b"), try_suffixes=(".weight",))] = per_head[:, nope:]
            continue
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    for (layer, projection), per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in sorted(per_expert)])
        tensors[f"{names.get_name(f'model.layers.{layer}.mlp.experts.{projection}')}.weight"] = stacked
    return tensors


def write_deepseek2_gguf(hf_folder, path, split_kv_b: bool, matrix_type: str = "F32", decoded: bool = False) -> None:
    """``matrix_type`` (F32, Q8_0...): the attention's matrices, whose rows fit its blocks;
    ``decoded``: those blocks written back as float32, as gguf's own decoder reads them."""
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    add_hparams(writer, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    weights = {name: np.array(t, dtype=np.float32) for name, t in mx.load(str(hf_folder / "model.safetensors")).items()}
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, w in llama_cpp_tensors(config, weights, split_kv_b).items():
        if w.ndim >= 2 and matrix_type != "F32" and w.shape[-1] % 32 == 0 and ".attn_" in name:
            blocks = gguf.quants.quantize(w, qtype)
            if decoded:
                writer.add_tensor(name, gguf.quants.dequantize(blocks, qtype).astype(np.float32))
            else:
                writer.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case, split_kv_b", [("deepseek_v3", False), ("deepseek_v3", True),
                                               ("deepseek_v3_yarn", True), ("deepseek_v2", False)])
def test_deepseek2_gguf_matches_transformers(case, split_kv_b, tmp_path):
    hf = make_hf_model(case, tmp_path / "hf")
    write_deepseek2_gguf(tmp_path / "hf", tmp_path / "model.gguf", split_kv_b)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == ("deepseek_v2" if case == "deepseek_v2" else "deepseek_v3")
    model, _ = load_model(tmp_path / "out")
    ours = np.array(model(mx.array([IDS]))[0])
    np.testing.assert_allclose(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("split_kv_b", [False, True])
def test_deepseek2_gguf_q8_0_blocks(split_kv_b, tmp_path):
    """Q8_0 attention matrices (attn_k_b's per-head blocks too) are carried over as 8-bit
    groups, a whole attn_kv_b dequantized once on loading (into embed_q, unembed_out): the
    logits of the file as gguf decodes it."""
    make_hf_model("deepseek_v3", tmp_path / "hf")
    for decoded in (False, True):
        write_deepseek2_gguf(tmp_path / "hf", tmp_path / f"{decoded}.gguf", split_kv_b, "Q8_0", decoded)
        convert(tmp_path / f"{decoded}.gguf", tmp_path / f"out-{decoded}", dtype="float32", **QUIET)
    assert json.loads((tmp_path / "out-False" / "config.json").read_text())["quantization"]["bits"] == 8
    weights = mx.load(str(tmp_path / "out-False" / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_b_proj.weight"].dtype == mx.uint32
    assert (weights["model.layers.0.self_attn.embed_q.weight"].dtype == mx.uint32) == split_kv_b
    logits = [np.array(load_model(tmp_path / f"out-{decoded}")[0](mx.array([IDS]))[0]) for decoded in (False, True)]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4, rtol=0)
