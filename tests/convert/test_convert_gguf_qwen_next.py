"""llama.cpp's GGUF files of Qwen3-Next (qwen3next), Qwen3.5 (qwen35) and Qwen3.5-MoE
(qwen35moe) -> ours: a tiny transformers model written as llama.cpp's converter
(Qwen3NextModel and the Qwen3.5 classes after it) writes it, with gguf's own tensor-name map
and metadata keys, converts to transformers' logits over a prompt of several delta-rule
chunks."""

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import hf_logits, make_hf_model
from fixtures.gguf_names import byte_tokens
from mlx.utils import tree_flatten

from mlx_tfm.convert.converter import convert
from mlx_tfm.errors import UserError
from mlx_tfm.loading import load_model

IDS = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 120, 45]
# 150 positions: two whole chunks of the delta rule (64) and part of a third
LONG_PROMPT = [int(i) for i in np.random.default_rng(0).integers(3, 256, 150)]
QUIET = dict(log=lambda *_: None)
Q8_0 = __import__("gguf").GGMLQuantizationType.Q8_0
ARCH_OF = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}


# -- the test-side writer: what llama.cpp's converter does ------------------------------------


def grouped_to_tiled(w: np.ndarray, axis: int, config: dict) -> np.ndarray:
    """_LinearAttentionVReorderBase: value heads grouped by key head (key_heads, per_key,
    width) -> tiled (per_key, key_heads, width) along ``axis``."""
    n_key, n_value = config["linear_num_key_heads"], config["linear_num_value_heads"]
    moved = np.moveaxis(w, axis, 0)
    grouped = moved.reshape(n_key, n_value // n_key, moved.shape[0] // n_value, *moved.shape[1:])
    return np.moveaxis(np.ascontiguousarray(grouped.swapaxes(0, 1)).reshape(moved.shape), 0, axis)


def tiled_value_heads(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """The Qwen3.5 converters' reorder of every tensor that holds value heads."""
    qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([w[:qk], grouped_to_tiled(w[qk:], 0, config)])
    if name.endswith(("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", ".A_log", ".dt_bias")):
        return grouped_to_tiled(w, 0, config)
    if name.endswith("out_proj.weight"):
        return grouped_to_tiled(w, 1, config)
    return w


def split_qkvz(w: np.ndarray, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3NextModel: in_proj_qkvz's rows, [q, k, v, z] per key head -> (all q, all k, all
    v) and z."""
    n_key, Dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    per_key_v = config["linear_num_value_heads"] // n_key * config["linear_value_head_dim"]
    grouped = w.reshape(n_key, 2 * Dk + 2 * per_key_v, -1)  # (key heads, rows per key head, D)
    bounds = np.cumsum([0, Dk, Dk, per_key_v, per_key_v])
    q, k, v, z = (grouped[:, a:b].reshape(-1, w.shape[-1]) for a, b in zip(bounds, bounds[1:]))
    return np.concatenate([q, k, v]), np.ascontiguousarray(z)


def llama_cpp_layout(name: str, w: np.ndarray, config: dict) -> tuple[str, np.ndarray]:
    """Qwen3NextModel.modify_tensors' element-wise steps (after the Qwen3.5 reorder)."""
    tiled = config["model_type"] != "qwen3_next" and config["linear_num_key_heads"] != config["linear_num_value_heads"]
    if tiled and ".linear_attn." in name:
        w = tiled_value_heads(name, w, config)
    if name.endswith(".A_log"):
        w = -np.exp(w)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif "conv1d" in name:
        w = w[:, 0, :]  # squeezed: (channels, kernel)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1.0
    return name, np.ascontiguousarray(w, dtype=np.float32)


def llama_cpp_tensors(arch, config: dict, weights: dict) -> dict[str, np.ndarray]:
    """The checkpoint in llama.cpp's names (gguf's TensorNameMap), experts stacked
    (experts, out, in) as Qwen2MoeModel merges them."""
    import gguf

    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors, experts = {}, {}
    for name, w in weights.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if ".mlp.experts." in name:  # model.layers.N.mlp.experts.E.gate_proj.weight
            experts.setdefault((layer, name.split(".")[6]), {})[int(name.split(".")[5])] = w
            continue
        if name.endswith("in_proj_qkvz.weight"):
            qkv, z = split_qkvz(w, config)
            tensors[f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_QKV].format(bid=layer)}.weight"] = qkv
            tensors[f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_GATE].format(bid=layer)}.weight"] = z
            continue
        name, w = llama_cpp_layout(name, w, config)
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    for (layer, projection), per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in sorted(per_expert)])  # (experts, out, in)
        tensors[names.get_name(f"model.layers.{layer}.mlp.experts.{projection}.weight",
                               try_suffixes=(".weight",))] = stacked
    return tensors


def write_hparams(writer, config: dict, interval: int, extra_blocks: int, dense_width: bool) -> None:
    """TextModel's, Qwen2MoeModel's and Qwen3NextModel's set_gguf_parameters (the Qwen3.5
    classes add the M-RoPE sections); TextModel writes feed_forward_length only when the
    config has an intermediate_size (``dense_width``)."""
    rope = config["rope_parameters"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"] + extra_blocks)
    if dense_width:
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if "num_experts" in config:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    if config["model_type"] != "qwen3_next":
        writer.add_rope_dimension_sections([11, 11, 10, 0])


def write_qwen_next_gguf(hf_folder, path, interval: int = 4, edit=None, hparams=None, extra_blocks: int = 0,
                         q8_0: tuple[str, ...] = (), dense_width: bool = True) -> None:
    """``edit(tensors)`` changes the llama.cpp tensors, ``hparams(writer)`` adds metadata,
    before writing; ``extra_blocks`` more blocks than the model's (ones ``edit`` adds); the
    tensors whose names end with one of ``q8_0`` are written in Q8_0 blocks."""
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    arch_name = ARCH_OF[config["model_type"]]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    writer = gguf.GGUFWriter(str(path), arch_name)
    write_hparams(writer, config, interval, extra_blocks, dense_width)
    if hparams:
        hparams(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35" if arch_name != "qwen3next" else "qwen2")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    weights = {name: np.array(t, dtype=np.float32) for name, t in mx.load(str(hf_folder / "model.safetensors")).items()}
    tensors = llama_cpp_tensors(arch, config, weights)
    if edit:
        edit(tensors)
    for name, w in tensors.items():
        if name.endswith(q8_0):
            writer.add_tensor(name, gguf.quants.quantize(w, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits_of(folder, ids: list[int]) -> np.ndarray:
    model, _ = load_model(folder)
    return np.array(model(mx.array([ids]))[0])


def float64_logits(hf, ids: list[int]) -> np.ndarray:
    """transformers' logits in float64 (any float32 run of these random models, its own or
    ours, drifts from them by up to a few 1e-4 over a long prompt)."""
    import torch

    hf.set_experts_implementation("eager")  # the grouped expert products have no float64
    with torch.no_grad():
        return hf.double()(torch.tensor([ids])).logits[0].numpy()


# -- parity --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(ARCH_OF))
def test_qwen_next_gguf_matches_transformers(case, tmp_path):
    hf = make_hf_model(case, tmp_path / "hf")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    assert config["layer_types"] == hf.config.layer_types
    np.testing.assert_allclose(logits_of(tmp_path / "out", IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5_moe_text"])
def test_mixture_gguf_without_a_dense_width(case, tmp_path):
    """A mixture whose config has no intermediate_size: its file has no feed_forward_length."""
    hf = make_hf_model(case, tmp_path / "hf")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf", dense_width=False)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    np.testing.assert_allclose(logits_of(tmp_path / "out", IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", list(ARCH_OF))
def test_qwen_next_gguf_reads_back_the_checkpoint_over_several_chunks(case, tmp_path):
    """Every weight of the model read from the GGUF file is that of the Hugging Face
    checkpoint's (the folder converted directly; Qwen3-Next's fused projections split), so over a prompt of several delta-rule chunks the two give the
    same logits, within float32 reach of transformers' float64 ones."""
    hf = make_hf_model(case, tmp_path / "hf")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    convert(tmp_path / "hf", tmp_path / "direct", **QUIET)
    ours, direct = (dict(tree_flatten(load_model(tmp_path / f)[0].parameters())) for f in ("out", "direct"))
    assert sorted(ours) == sorted(direct)
    for name, tensor in direct.items():  # A_log's exp and log round trip is the one inexact step
        np.testing.assert_allclose(np.array(ours[name]), np.array(tensor), atol=1e-6, rtol=1e-6, err_msg=name)
    from_gguf = logits_of(tmp_path / "out", LONG_PROMPT)
    # A_log's round trip (1e-6) through every decay of the prompt: up to 1.05e-5 apart in the CPU kernel's float32
    np.testing.assert_allclose(from_gguf, logits_of(tmp_path / "direct", LONG_PROMPT), atol=2e-5, rtol=0)
    np.testing.assert_allclose(from_gguf, float64_logits(hf, LONG_PROMPT), atol=5e-4, rtol=0)


# -- the layer pattern ---------------------------------------------------------------------------


def drop(*names):
    def edit(tensors):
        for name in names:
            del tensors[name]
    return edit


@pytest.mark.parametrize("interval, edit, message", [
    (3, None, ("GGUF qwen35 layer pattern is unknown: layer 2 holds linear_attention tensors, "
               "full_attention_interval 3 makes it full_attention")),
    (4, drop("blk.1.ssm_a"), "GGUF qwen35 layer 1 is of no known kind: it holds attn_gate.weight"),
    (0, None, "GGUF qwen35 full_attention_interval is 0: it must be 1 or more"),
])
def test_unknown_layer_pattern_is_named(interval, edit, message, tmp_path):
    make_hf_model("qwen3_5_text", tmp_path / "hf")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf", interval=interval, edit=edit)
    with pytest.raises(UserError, match=message) as error:
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert "\n" not in str(error.value)


def test_appended_prediction_layers_are_left_out(tmp_path):
    """Newer converters append Qwen3.5's multi-token-prediction layer as one more block
    (a full-attention layer and the nextn.* projections; nextn_predict_layers 1): the
    language model is the blocks before it."""
    import gguf

    def mtp_block(tensors):
        for name in [n for n in tensors if n.startswith("blk.3.")]:  # a full-attention block's tensors
            tensors[name.replace("blk.3.", "blk.4.")] = tensors[name]
        for tensor, shape in ((gguf.MODEL_TENSOR.NEXTN_EH_PROJ, (64, 128)), (gguf.MODEL_TENSOR.NEXTN_ENORM, (64,)),
                              (gguf.MODEL_TENSOR.NEXTN_HNORM, (64,)), (gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM, (64,))):
            tensors[f"{gguf.TENSOR_NAMES[tensor].format(bid=4)}.weight"] = np.ones(shape, dtype=np.float32)

    hf = make_hf_model("qwen3_5_text", tmp_path / "hf")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf", edit=mtp_block, extra_blocks=1,
                         hparams=lambda writer: writer.add_nextn_predict_layers(1))
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 4
    np.testing.assert_allclose(logits_of(tmp_path / "out", IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)



# -- quantized value heads -------------------------------------------------------------------


def round_trip_q8_0(hf, parts: tuple[str, ...]) -> None:
    """The transformers model with its ``parts`` weights as Q8_0 blocks give them back
    (gguf's reference quantizer and decoder), in the checkpoint's own grouped order."""
    import gguf
    import torch

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(parts):
                decoded = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), Q8_0), Q8_0)
                p.copy_(torch.from_numpy(np.ascontiguousarray(decoded)))


def test_quantized_tiled_value_heads_are_put_back_a_block_at_a_time(tmp_path):
    """Value heads of 32 fill one Q8_0 block each: out_proj's tiled column blocks and
    in_proj_qkv's rows are put back as they are stored (bit for bit), so the logits are
    those of the checkpoint with the same weights quantized in its own order."""
    hf = make_hf_model("qwen3_5_text", tmp_path / "hf", linear_value_head_dim=32)
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf", q8_0=("ssm_out.weight", "attn_qkv.weight"))
    convert(tmp_path / "model.gguf", tmp_path / "out", dtype="float32", **QUIET)
    round_trip_q8_0(hf, ("linear_attn.out_proj.weight", "linear_attn.in_proj_qkv.weight"))
    assert "model.layers.0.linear_attn.out_proj.scales" in mx.load(str(tmp_path / "out" / "model.safetensors"))
    np.testing.assert_allclose(logits_of(tmp_path / "out", IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_quantized_value_heads_smaller_than_a_block_are_an_error(tmp_path):
    make_hf_model("qwen3_5_text", tmp_path / "hf")  # value heads of 8
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf", q8_0=("ssm_out.weight",))
    message = ("GGUF qwen35 tensor blk.0.ssm_out.weight [(]Q8_0[)]: value heads of 8 weights do not fill whole "
               "32-weight blocks, so its tiled heads cannot be reordered")
    with pytest.raises(UserError, match=message):
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)


def test_norm_stored_in_blocks_is_an_error(tmp_path):
    """llama.cpp keeps norms in F32; one in blocks cannot have its 1 taken off."""
    make_hf_model("qwen3_5_text", tmp_path / "hf")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf", q8_0=("blk.0.attn_norm.weight",))
    with pytest.raises(UserError, match="GGUF norm model.layers.0.input_layernorm.weight is not stored as float"):
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)


def test_value_heads_not_whole_per_key_head_are_an_error(tmp_path, monkeypatch):
    import gguf

    make_hf_model("qwen3_5_text", tmp_path / "hf")
    real = gguf.GGUFWriter.add_ssm_time_step_rank
    monkeypatch.setattr(gguf.GGUFWriter, "add_ssm_time_step_rank", lambda writer, _: real(writer, 3))
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    message = ("GGUF qwen35 has 3 value heads [(]ssm.time_step_rank[)] for 2 key heads [(]ssm.group_count[)]: "
               "not a whole number per key head")
    with pytest.raises(UserError, match=message):
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)


def older_qwen3next_layout(hf_folder):
    """The layout older converters wrote (and newer ones' fused experts): each linear
    attention layer's in_proj_qkvz whole as ssm_in, in place of attn_qkv and attn_gate, and
    each layer's gate and up experts as one ffn_gate_up_exps (experts, 2F, D), gate rows first."""
    weights = mx.load(str(hf_folder / "model.safetensors"))

    def edit(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(".attn_qkv.weight")]:
            layer = name.split(".")[1]
            del tensors[name], tensors[f"blk.{layer}.attn_gate.weight"]
            qkvz = weights[f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"]
            tensors[f"blk.{layer}.ssm_in.weight"] = np.array(qkvz, dtype=np.float32)
        for name in [n for n in tensors if n.endswith(".ffn_gate_exps.weight")]:
            gate, up = tensors.pop(name), tensors.pop(name.replace("ffn_gate_exps", "ffn_up_exps"))
            tensors[name.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate([gate, up], axis=1)

    return edit


def test_older_qwen3next_layout_matches_transformers(tmp_path):
    """Both layouts llama.cpp has written for qwen3next import: ssm_in (in_proj_qkvz whole)
    and fused gate-up experts give transformers' logits."""
    hf = make_hf_model("qwen3_next", tmp_path / "hf")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "model.gguf", edit=older_qwen3next_layout(tmp_path / "hf"))
    assert {"blk.0.ssm_in.weight", "blk.0.ffn_gate_up_exps.weight"} <= {
        t.name for t in __import__("gguf").GGUFReader(str(tmp_path / "model.gguf")).tensors}
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    np.testing.assert_allclose(logits_of(tmp_path / "out", IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_older_qwen3next_layout_in_q8_0_blocks_equals_the_newer(tmp_path):
    """Q8_0 blocks quantize each row alone: ssm_in's and the fused experts' rows, split on
    reading, compute exactly what the newer layout's split tensors do."""
    make_hf_model("qwen3_next", tmp_path / "hf")
    blocks = ("ssm_in.weight", "attn_qkv.weight", "attn_gate.weight", "_exps.weight")
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "old.gguf", edit=older_qwen3next_layout(tmp_path / "hf"),
                         q8_0=blocks)
    write_qwen_next_gguf(tmp_path / "hf", tmp_path / "new.gguf", q8_0=blocks)
    for kind in ("old", "new"):
        convert(tmp_path / f"{kind}.gguf", tmp_path / kind, **QUIET)
    assert json.loads((tmp_path / "old" / "config.json").read_text())["quantization"]["bits"] == 8
    np.testing.assert_array_equal(logits_of(tmp_path / "old", IDS), logits_of(tmp_path / "new", IDS))
