"""llama.cpp's GGUF files of the hybrid families (lfm2, lfm2moe, mamba2, mamba) -> ours: a
tiny transformers model written as llama.cpp's converter writes it (gguf's own tensor-name
map and metadata keys; conv weights squeezed, A stored as -exp(A_log), Mamba-2's A and D
unsqueezed and its norm grouped, experts stacked) converts to the same logits."""

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import half_split_to_interleaved, hf_logits, make_hf_model
from fixtures.gguf_names import byte_tokens, llama_cpp_tensor_names

from mlx_tfm.convert.converter import convert
from mlx_tfm.convert.gguf_file import gguf_name, hf_name
from mlx_tfm.convert.gguf_hybrids import HYBRID_ARCHITECTURES
from mlx_tfm.errors import UserError
from mlx_tfm.loading import load_model

IDS = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 120, 45]
QUIET = dict(log=lambda *_: None)


def lfm2_hparams(writer, config: dict) -> None:
    """LFM2Model.set_gguf_parameters: head_count_kv per layer (0 on conv layers), the
    feed-forward width as Lfm2MLP derives it."""
    from mlx_tfm.families.convolutions import lfm2_ff_dim

    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([config["num_key_value_heads"] if t != "conv" else 0 for t in config["layer_types"]])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_shortconv_l_cache(config["conv_L_cache"])
    writer.add_layer_norm_rms_eps(config["norm_eps"])
    if config["model_type"] == "lfm2":
        writer.add_feed_forward_length(lfm2_ff_dim(config))
        return
    import gguf

    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_leading_dense_block_count(config["num_dense_layers"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def mamba2_hparams(writer, config: dict) -> None:
    """Mamba2Model.set_gguf_parameters: the heads as ssm.time_step_rank."""
    inner = config["expand"] * config["hidden_size"]
    ssm_hparams(writer, config, inner)
    writer.add_ssm_time_step_rank(inner // config["head_dim"])
    writer.add_ssm_group_count(config["n_groups"])


def mamba_hparams(writer, config: dict) -> None:
    ssm_hparams(writer, config, config["intermediate_size"])
    writer.add_ssm_time_step_rank(config["time_step_rank"])
    writer.add_ssm_dt_b_c_rms(False)


def attention_layers(config: dict) -> list[bool]:
    """Which layers attend: Granite 4's layer_types, Nemotron-H's layers_block_type."""
    kinds = config.get("layer_types") or config["layers_block_type"]
    return [k in ("full_attention", "attention") for k in kinds]


def hybrid_attention_hparams(writer, config: dict, inner: int, heads: int, groups: int, state: int, kernel: int) -> None:
    """What GraniteHybridModel.set_gguf_parameters writes for both (Nemotron-H derives from
    it): head_count_kv per layer (0 off attention), the Mamba-2 widths, no RoPE."""
    attends = attention_layers(config)
    writer.add_context_length(2**20)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"] if "layer_types" in config else len(attends))
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([config["num_key_value_heads"] if a else 0 for a in attends])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_ssm_conv_kernel(kernel)
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(groups)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(heads)
    writer.add_rope_scaling_finetuned(False)  # hybrid Granite 4 and Nemotron-H: no RoPE


def granitehybrid_hparams(writer, config: dict) -> None:
    heads, head_dim = config["mamba_n_heads"], config["mamba_d_head"]
    hybrid_attention_hparams(writer, config, heads * head_dim, heads, config["mamba_n_groups"],
                             config["mamba_d_state"], config["mamba_d_conv"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_attention_scale(config["attention_multiplier"])
    writer.add_embedding_scale(config["embedding_multiplier"])
    writer.add_residual_scale(config["residual_multiplier"])
    writer.add_logit_scale(config["logits_scaling"])
    writer.add_expert_shared_feed_forward_length(config["shared_intermediate_size"])


def nemotron_h_hparams(writer, config: dict) -> None:
    heads, head_dim = config["mamba_num_heads"], config["mamba_head_dim"]
    hybrid_attention_hparams(writer, config, heads * head_dim, heads, config["n_groups"], config["ssm_state_size"],
                             config["conv_kernel"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_feed_forward_length([config["intermediate_size"] if k == "mlp" else 0
                                    for k in config["layers_block_type"]])


def falcon_h1_hparams(writer, config: dict) -> None:
    """Mamba2Model's keys as FalconH1Model overrides them, attention's beside them."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_value_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_ssm_conv_kernel(config["mamba_d_conv"])
    writer.add_ssm_inner_size(config["mamba_d_ssm"])
    writer.add_ssm_state_size(config["mamba_d_state"])
    writer.add_ssm_time_step_rank(config["mamba_d_ssm"] // config["mamba_d_head"])
    writer.add_ssm_group_count(config["mamba_n_groups"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def falcon_h1_folded(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """FalconH1Model.modify_tensors: each muP multiplier folded into its weight, in_proj's
    z, x, B, C, dt rows each by its ssm_multipliers entry."""
    scales = [("down_proj", config["mlp_multipliers"][1]), ("gate_proj", config["mlp_multipliers"][0]),
              ("k_proj", config["key_multiplier"] * config["attention_in_multiplier"]),
              ("q_proj", config["attention_in_multiplier"]), ("v_proj", config["attention_in_multiplier"]),
              ("o_proj", config["attention_out_multiplier"]), ("out_proj", config["ssm_out_multiplier"]),
              ("in_proj", config["ssm_in_multiplier"]), ("lm_head", config["lm_head_multiplier"]),
              ("embed_tokens", config["embedding_multiplier"])]
    scale = next((m for part, m in scales if part in name), 1.0)
    w = w * scale
    if "in_proj" in name:
        inner, groups = config["mamba_d_ssm"], config["mamba_n_groups"] * config["mamba_d_state"]
        bounds = np.cumsum([0, inner, inner, groups, groups, w.shape[0] - 2 * inner - 2 * groups])
        rows = np.concatenate([np.full(b - a, m) for a, b, m in zip(bounds, bounds[1:], config["ssm_multipliers"])])
        w = w * rows[:, None].astype(np.float32)
    return w


def ssm_hparams(writer, config: dict, inner: int) -> None:
    writer.add_context_length(2**20)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_ssm_conv_kernel(config["conv_kernel"])
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(config["state_size"])
    writer.add_layer_norm_rms_eps(config["layer_norm_epsilon"])


# Converters of the Llama lineage (GraniteHybridModel, NemotronHModel after it) permute q/k rows.
PERMUTED_QK = ("granitemoehybrid", "nemotron_h")


def llama_cpp_layout(name: str, w: np.ndarray, config: dict) -> tuple[str, np.ndarray]:
    """What the converters' modify_tensors do before naming: squeeze conv weights,
    A_log -> -exp(A_log), Mamba-2's A and D unsqueezed, its norm grouped, dt_bias named
    as a dt_proj bias, the expert bias as a bias."""
    if config["model_type"] == "falcon_h1":
        w = falcon_h1_folded(name, w, config)
    mamba2 = config["model_type"] != "mamba"  # Mamba-2 mixers, where a family has any
    if w.ndim == 3 and (name.endswith("conv.conv.weight") or name.endswith("conv1d.weight")):
        w = w[:, 0, :]  # (channels, kernel)
    if name.endswith(".A_log"):
        w = -np.exp(w)
    if mamba2 and (name.endswith(".A_log") or name.endswith(".D")):
        w = w[:, None]  # (heads, 1)
    if mamba2 and name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
        w = w.reshape(config.get("n_groups") or config["mamba_n_groups"], -1)  # (groups, inner / groups)
    if name.endswith(("q_proj.weight", "k_proj.weight")) and config["model_type"] in PERMUTED_QK:
        heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
        w = half_split_to_interleaved(w, heads)  # GraniteHybridModel's undo_permute (LlamaModel.permute)
    name = name.replace(".dt_bias", ".dt_proj.bias").replace(".expert_bias", ".expert_bias.bias")
    return name, np.ascontiguousarray(w)


def llama_cpp_tensors(arch, config: dict, weights: dict) -> dict[str, np.ndarray]:
    """The checkpoint in llama.cpp's names (gguf's TensorNameMap), experts stacked
    (experts, out, in) as LFM2MoeModel merges them."""
    import gguf

    names = gguf.get_tensor_name_map(arch, 64)
    tensors, experts = {}, {}
    for name, w in weights.items():
        if name.endswith("input_linear.weight"):  # Granite 4: gate rows, then up rows
            gate_up = "exps" if w.ndim == 3 else "shexp"
            half = w.shape[-2] // 2
            tensors[f"blk.{name.split('.')[2]}.ffn_gate_{gate_up}.weight"] = np.ascontiguousarray(w[..., :half, :])
            tensors[f"blk.{name.split('.')[2]}.ffn_up_{gate_up}.weight"] = np.ascontiguousarray(w[..., half:, :])
            continue
        if ".experts." in name:  # model.layers.N.feed_forward.experts.E.wK.weight
            parts = name.split(".")
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = w
            continue
        name, w = llama_cpp_layout(name, w, config)
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    for (layer, projection), per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in sorted(per_expert)])  # (experts, out, in)
        # LFM2MoeModel names the merged experts without the model. prefix
        tensors[f"{names.get_name(f'layers.{layer}.feed_forward.experts.{projection}')}.weight"] = stacked
    return tensors


HPARAMS = {"lfm2": lfm2_hparams, "lfm2moe": lfm2_hparams, "mamba2": mamba2_hparams, "mamba": mamba_hparams,
           "granitehybrid": granitehybrid_hparams, "nemotron_h": nemotron_h_hparams, "falcon-h1": falcon_h1_hparams}


def write_hybrid_gguf(hf_folder, path, arch_name: str, edit=None) -> None:
    """``edit(tensors)``: change the llama.cpp tensors before writing (error cases)."""
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    writer = gguf.GGUFWriter(str(path), arch_name)
    HPARAMS[arch_name](writer, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
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
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# (TINY_CONFIGS case, llama.cpp architecture, config overrides). LFM2MoeModel writes no
# routed scaling, so the model here has none (1.0, as LFM2-8B-A1B ships).
CASES = {
    "lfm2": ("lfm2", "lfm2", {}),
    "lfm2_conv_bias": ("lfm2_conv_bias", "lfm2", {}),
    "lfm2_moe": ("lfm2_moe", "lfm2moe", {"routed_scaling_factor": 1.0}),
    "mamba2": ("mamba2", "mamba2", {}),
    "mamba2_groups": ("mamba2", "mamba2", {"n_groups": 2}),
    "mamba": ("mamba", "mamba", {}),
    # Granite 4's hybrid checkpoints use no positions (llama.cpp's granitehybrid applies none)
    "granitemoehybrid": ("granitemoehybrid", "granitehybrid", {"position_embedding_type": "nope"}),
    "nemotron_h": ("nemotron_h", "nemotron_h", {}),
    "falcon_h1": ("falcon_h1", "falcon-h1", {}),
}


@pytest.mark.parametrize("name", CASES)
def test_hybrid_gguf_matches_transformers(name, tmp_path):
    case, arch_name, overrides = CASES[name]
    hf = make_hf_model(case, tmp_path / "hf", **overrides)
    write_hybrid_gguf(tmp_path / "hf", tmp_path / "model.gguf", arch_name)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type
    model, _ = load_model(tmp_path / "out")
    ours = np.array(model(mx.array([IDS]))[0])
    np.testing.assert_allclose(ours, hf_logits(hf, IDS), atol=1e-4, rtol=0)


def drop_layer_mixer(prefix: str):
    def edit(tensors):
        for name in [n for n in tensors if n.startswith(prefix)]:
            del tensors[name]
    return edit


@pytest.mark.parametrize("case, arch_name, prefix, message", [
    ("lfm2", "lfm2", "blk.2.shortconv.", "GGUF lfm2 layer 2 is of no known kind: it holds attn_norm.weight"),
    ("mamba2", "mamba2", "blk.1.ssm_in.", "GGUF mamba2 layer 1 is of no known kind: it holds attn_norm.weight"),
])
def test_hybrid_gguf_unknown_layer_kind_is_named(case, arch_name, prefix, message, tmp_path):
    make_hf_model(case, tmp_path / "hf")
    write_hybrid_gguf(tmp_path / "hf", tmp_path / "model.gguf", arch_name, edit=drop_layer_mixer(prefix))
    with pytest.raises(UserError, match=message) as error:
        convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("arch", sorted(HYBRID_ARCHITECTURES))
def test_hybrid_gguf_names_are_the_inverse_of_hf_names_and_llama_cpps(arch):
    """As test_convert_gguf's check of the other families: writing undoes reading for every
    tensor llama.cpp names, and agrees with gguf's own TensorNameMap where it has the name."""
    import gguf

    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    theirs = gguf.get_tensor_name_map(model_arch, 4)
    ours = {name: hf_name(name, arch) for name in llama_cpp_tensor_names(arch)}
    read = {name: hf for name, hf in ours.items() if hf != name}
    assert len(read) >= 14
    for name, hf in read.items():
        assert gguf_name(hf, arch) == name
        assert theirs.get_name(hf, try_suffixes=(".weight", ".bias")) in (None, name), hf


@pytest.mark.parametrize("case, arch_name, hf_name_, ours", [
    ("granitemoehybrid", "granitehybrid", "model.layers.1.self_attn.{}_proj.weight", "model.layers.1.self_attn.{}_proj.weight"),
    ("nemotron_h", "nemotron_h", "backbone.layers.2.mixer.{}_proj.weight", "backbone.layers.2.mixer.{}_proj.weight"),
])
def test_permuted_qk_rows_are_put_back(case, arch_name, hf_name_, ours, tmp_path):
    """Without positions the logits do not show llama.cpp's q/k row order: the weights do."""
    make_hf_model(case, tmp_path / "hf", **CASES[case][2])
    write_hybrid_gguf(tmp_path / "hf", tmp_path / "model.gguf", arch_name)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    theirs = mx.load(str(tmp_path / "hf" / "model.safetensors"))
    converted = mx.load(str(tmp_path / "out" / "model.safetensors"))
    for projection in ("q", "k"):
        np.testing.assert_array_equal(np.array(converted[ours.format(projection)]),
                                      np.array(theirs[hf_name_.format(projection)]))
