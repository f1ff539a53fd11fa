"""Every architecture in the table: a tiny random transformers model in its real Hugging
Face layout converts, and its float32 logits and greedy continuation match transformers'.
The folders we write also load in mlx-lm with the same logits."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.cli_runs import convert_error
from fixtures.encoder_models import T5_MODEL_TYPES, TINY_ENCODERS
from fixtures.convert_helpers import TINY_CONFIGS, greedy, hf_greedy, hf_logits, make_hf_model

from mlx_tfm.families import ARCHITECTURES
from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]  # longer than the sliding windows
QUIET = dict(log=lambda *_: None)


def our_logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_every_table_entry_has_a_parity_case():
    """Decoders are checked below; encoders in tests/model/test_encoders.py (TINY_ENCODERS) and
    the encoder-decoders there too (T5_MODEL_TYPES: t5 and mt5, flan-t5 being t5)."""
    covered = {TINY_CONFIGS[name].get("model_type", name) for name in TINY_CONFIGS}
    covered |= set(TINY_ENCODERS) | T5_MODEL_TYPES
    assert covered == set(ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_logits_and_greedy_match_transformers(name, tmp_path):
    hf = make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, config = load_model(tmp_path / "mlx")
    assert config["torch_dtype"] == "float32"
    reference = hf_logits(hf, PROMPT)
    np.testing.assert_allclose(our_logits(model, PROMPT), reference, atol=1e-4, rtol=0)
    assert greedy(model, PROMPT, 12) == hf_greedy(hf, PROMPT, 12)
    # the Hugging Face folder also loads directly, without converting
    direct, _ = load_model(tmp_path / "hf")
    np.testing.assert_allclose(our_logits(direct, PROMPT), reference, atol=1e-4, rtol=0)


# Where mlx-lm 0.32 computes something other than transformers (the test above holds us to
# transformers), and how far its logits land from ours on these tiny models.
MLX_LM_DIFFERS = {
    "gemma": (2e-3, "exact GELU where transformers uses the tanh form"),
    "starcoder2": (2e-3, "exact GELU where transformers uses the tanh form"),
    "gemma3_text": (1e-2, "embedding scale sqrt(hidden_size) rounded to bfloat16"),
    "gemma3": (1e-2, "embedding scale sqrt(hidden_size) rounded to bfloat16"),
    "gpt_oss": (5e-3, "YaRN with truncate false rounded as if true (test_moe.py shows it is only that)"),
    "gpt_neox": (2e-3, "the tanh form of GELU where transformers uses the exact one"),
    "gpt_neox_sequential": (2e-3, "the tanh form of GELU where transformers uses the exact one"),
    "gpt_bigcode": (2e-3, "exact GELU where transformers uses the tanh form"),
    "glm": (2.0, "mlx-lm rotates the whole head where transformers rotates half (partial_rotary_factor)"),
    "ernie4_5_moe": (0.3, "mlx-lm drops the router's e_score_correction_bias, so some positions choose other experts"),
}
# model_types mlx-lm 0.32 has no model file for
MLX_LM_LACKS = ("arcee", "ministral", "qwen3_5_text", "qwen3_5_moe_text", "hunyuan_v1_moe", "granitemoeshared", "cwm",
                "vaultgemma", "flex_olmo", "sarvam_moe", "opt", "biogpt",
                "idefics3", "smolvlm", "llava_next",  # image-text models mlx-lm has no text-only reading of
                "lfm2_vl")  # mlx-lm's is "lfm2-vl" (transformers 4's name)
# Cases whose mechanisms mlx-lm 0.32's file of that model_type lacks (its own test covers what it has).
MLX_LM_NARROWER = {
    "llama4_text": "mlx-lm's llama4_text is a dense model (MobileLLM): tests/families/test_llama4.py",
    "llama4": "mlx-lm's llama4 takes one expert per token, no RoPE on every 4th layer: tests/families/test_llama4.py",
    "minimax": "mlx-lm's minimax is MiniMax-M2 (softmax attention only): tests/families/test_minimax_family.py",
}
IN_MLX_LM = sorted(name for name in TINY_CONFIGS
                   if TINY_CONFIGS[name].get("model_type", name) not in MLX_LM_LACKS and name not in MLX_LM_NARROWER)


@pytest.mark.parametrize("name", IN_MLX_LM)
@pytest.mark.parametrize("quantize", [False, True], ids=["float", "4bit"])
def test_output_loads_in_mlx_lm(name, quantize, tmp_path):
    """The on-disk layout is mlx-lm's, float and quantized (fused phi3/gpt2 tensors
    included): mlx-lm and we compute the same logits from the same folder."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", quantize=quantize, q_group_size=32, **QUIET)
    ours, _ = load_model(tmp_path / "mlx")
    theirs, _ = mlx_lm_load_model(tmp_path / "mlx")
    short = PROMPT[:5]  # inside every sliding window, which mlx-lm's full forward ignores
    atol = MLX_LM_DIFFERS[name][0] if name in MLX_LM_DIFFERS else 1e-4
    np.testing.assert_allclose(our_logits(ours, short), our_logits(theirs, short), atol=atol, rtol=0)


@pytest.mark.parametrize("model_type", MLX_LM_LACKS)
def test_mlx_lm_lacks_these_families(model_type, tmp_path):
    """Ours only: when mlx-lm gains one of them, move it to the test above."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    name = next(n for n in TINY_CONFIGS if TINY_CONFIGS[n].get("model_type", n) == model_type)
    make_hf_model(name, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    with pytest.raises(ValueError, match=f"Model type {model_type} not supported"):
        mlx_lm_load_model(tmp_path / "mlx")


def test_quantized_conversion_is_close_to_float(tmp_path):
    hf = make_hf_model("phi3", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32, **QUIET)
    model, config = load_model(tmp_path / "q8")
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    weights = mx.load(str(tmp_path / "q8" / "model.safetensors"))
    assert weights["model.layers.0.self_attn.qkv_proj.weight"].dtype == mx.uint32
    reference = hf_logits(hf, PROMPT)
    assert np.abs(our_logits(model, PROMPT) - reference).max() < 0.05 * np.abs(reference).max()


def test_sharded_safetensors_in_and_out(tmp_path):
    hf = make_hf_model("llama", tmp_path / "hf")
    hf.save_pretrained(tmp_path / "hf_sharded", max_shard_size="40KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").is_file()
    convert(tmp_path / "hf_sharded", tmp_path / "mlx", max_shard_size="30KB", **QUIET)
    out = tmp_path / "mlx"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert not (out / "model.safetensors").exists()
    model, _ = load_model(out)
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


def test_pytorch_bin_source(tmp_path):
    import torch

    hf = make_hf_model("qwen2", tmp_path / "hf")
    source = tmp_path / "torch"
    source.mkdir()
    (source / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    torch.save(hf.state_dict(), source / "pytorch_model.bin")
    convert(source, tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)
    direct, _ = load_model(source)  # mlx_tfm loads a PyTorch-only folder through the converter
    np.testing.assert_allclose(our_logits(direct, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype_flag(dtype, tmp_path):
    make_hf_model("gemma", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", dtype=dtype, **QUIET)
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    weights = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    assert config["torch_dtype"] == dtype
    assert {str(v.dtype) for v in weights.values()} == {f"mlx.core.{dtype}"}


def test_mlx_quantized_folder_dequantizes_and_requantizes(tmp_path):
    """An mlx-community style (already quantized) folder loads as it is, --dequantize
    restores float weights, and converting it again copies it unchanged."""
    make_hf_model("llama", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "q4", quantize=True, q_group_size=32, **QUIET)
    quantized, _ = load_model(tmp_path / "q4")
    convert(tmp_path / "q4", tmp_path / "copy", **QUIET)
    convert(tmp_path / "q4", tmp_path / "float", dequantize=True, dtype="float32", **QUIET)
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    floats, _ = load_model(tmp_path / "float")
    copy, _ = load_model(tmp_path / "copy")
    np.testing.assert_array_equal(our_logits(copy, PROMPT), our_logits(quantized, PROMPT))
    np.testing.assert_allclose(our_logits(floats, PROMPT), our_logits(quantized, PROMPT), atol=1e-4, rtol=0)


# -- config layouts: transformers 4's keys and transformers 5's read alike -------------------


def transformers_config_dict(model_type: str, keys: dict) -> dict:
    """What transformers 5 makes of ``keys`` (it rewrites 4's layout into its own)."""
    from transformers import AutoConfig

    keys = {k: v for k, v in keys.items() if k != "model_type"}
    return AutoConfig.for_model(model_type, **keys).to_dict()


GEMMA3_TEXT_V4 = dict(
    {k: v for k, v in TINY_CONFIGS["gemma3_text"].items() if k not in ("layer_types", "rope_parameters")},
    rope_theta=10000.0,
    rope_local_base_freq=100.0,
    rope_scaling={"rope_type": "linear", "factor": 4.0},
    sliding_window_pattern=2,
)


def test_gemma3_transformers4_config_layout():
    from mlx_tfm.families import model_args_from_config

    v4 = {**GEMMA3_TEXT_V4, "model_type": "gemma3_text"}
    ours = model_args_from_config(v4)
    assert ours == model_args_from_config(transformers_config_dict("gemma3_text", GEMMA3_TEXT_V4))
    assert ours == model_args_from_config({**TINY_CONFIGS["gemma3_text"], "model_type": "gemma3_text"})
    assert ours.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (ours.rope_theta, ours.rope_local_theta, ours.rope_scaling["factor"]) == (10000.0, 100.0, 4.0)


def test_gemma3_hub_config_leaves_defaults_out():
    """An image-text config as google/gemma-3-4b-it ships it: its text_config names only what
    differs from transformers' defaults; we fill in the same values transformers does."""
    from mlx_tfm.families import model_args_from_config

    hub = {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    ours = model_args_from_config(hub)
    theirs = transformers_config_dict("gemma3", hub)["text_config"]
    assert ours.model_type == "gemma3"
    for field, key in [("vocab_size", "vocab_size"), ("num_attention_heads", "num_attention_heads"),
                       ("num_key_value_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                       ("norm_eps", "rms_norm_eps"), ("sliding_window", "sliding_window")]:
        assert getattr(ours, field) == theirs[key], field
    assert list(ours.layer_types) == theirs["layer_types"]
    full, sliding = theirs["rope_parameters"]["full_attention"], theirs["rope_parameters"]["sliding_attention"]
    assert (ours.rope_theta, ours.rope_scaling["factor"]) == (full["rope_theta"], full["factor"])
    assert ours.rope_local_theta == sliding["rope_theta"]
    assert ours.attention_scale == theirs["query_pre_attn_scalar"] ** -0.5
    assert ours.tie_word_embeddings and ours.qk_norm and ours.norm_placement == "sandwich"


def test_gemma3_transformers5_tensor_names(tmp_path):
    """Gemma 3 image-text weights named as transformers 5 holds them in memory
    (``model.language_model.*``, ``model.vision_tower.*``) load like the saved layout."""
    hf = make_hf_model("gemma3", tmp_path / "hf")
    renamed = {}
    for name, tensor in mx.load(str(tmp_path / "hf" / "model.safetensors")).items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        else:
            name = "model." + name
        renamed[name] = tensor
    mx.save_safetensors(str(tmp_path / "hf" / "model.safetensors"), renamed)
    convert(tmp_path / "hf", tmp_path / "mlx", **QUIET)
    model, _ = load_model(tmp_path / "mlx")
    names = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    # mlx-lm's layout for the language model; the vision side kept in the saved layout (vision.py)
    assert all(n.startswith(("language_model.model.", "vision_tower.", "multi_modal_projector.")) for n in names)
    assert any(n.startswith("language_model.model.") for n in names)
    np.testing.assert_allclose(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("theta", [500.0, 500000.0])
def test_olmo3_older_config_layout_reads_as_transformers_5_reads_it(theta):
    """A config with ``rope_theta`` and ``rope_scaling`` at the top (the released files'
    layout): the full layers take them, and the sliding layers rotate unscaled with the
    base transformers 5 gives them (its default, whatever ``rope_theta`` says)."""
    from transformers import AutoConfig

    from mlx_tfm.families import model_args_from_config

    older = {k: v for k, v in TINY_CONFIGS["olmo3"].items() if k != "rope_parameters"}
    older.update(model_type="olmo3", rope_theta=theta, rope_scaling={"rope_type": "linear", "factor": 2.0})
    reference = AutoConfig.for_model(**older).rope_parameters
    args = model_args_from_config(older)
    assert args.rope_theta == reference["full_attention"]["rope_theta"] == theta
    assert args.rope_scaling["factor"] == reference["full_attention"]["factor"]
    assert args.rope_local_theta == reference["sliding_attention"]["rope_theta"]
    assert reference["sliding_attention"]["rope_type"] == "default"


def test_phi_transformers4_config_layout():
    from mlx_tfm.families import model_args_from_config

    v5 = {**TINY_CONFIGS["phi"], "model_type": "phi"}
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, partial_rotary_factor=0.5)
    assert model_args_from_config(v4) == model_args_from_config(v5)
    assert model_args_from_config(v5) == model_args_from_config(transformers_config_dict("phi", v4))


@pytest.mark.parametrize(
    "model_type,keys,message",
    [
        ("phi", {"qk_layernorm": True}, "phi with qk_layernorm is not supported"),
        ("stablelm", {"qk_layernorm": True}, "stablelm with qk_layernorm is not supported"),
        ("cohere", {"use_qk_norm": True}, "cohere with use_qk_norm is not supported"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("olmo3", {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1.0}}},
         "sliding-window layers with 'yarn' RoPE scaling are not supported"),
    ],
)
def test_unsupported_family_options_are_one_line(model_type, keys, message, tmp_path, capsys):
    name = next(n for n in TINY_CONFIGS if TINY_CONFIGS[n].get("model_type", n) == model_type)
    make_hf_model(name, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **keys}))
    capsys.readouterr()  # transformers' progress bars
    assert message in convert_error(capsys, "--hf-path", tmp_path / "hf", "--mlx-path", tmp_path / "out")


def test_exaone4_letter_pattern_layout():
    """EXAONE 4 hub configs spell the window pattern in letters ("LLLG"); it reads as the
    layer_types transformers 5 derives."""
    from mlx_tfm.families import model_args_from_config

    theirs = transformers_config_dict("exaone4", TINY_CONFIGS["exaone4"])
    assert theirs["layer_types"] == ["sliding_attention", "full_attention"] * 2
    letters = {k: v for k, v in theirs.items() if k != "layer_types"}
    letters["sliding_window_pattern"] = "LG"
    assert model_args_from_config(letters) == model_args_from_config(theirs)
