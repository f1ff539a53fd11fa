"""Every architecture in the table: a tiny random transformers model in its real Hugging
Face layout converts, and its float32 logits and greedy continuation match transformers'.
The folders we write also load in mlx-lm with the same logits."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from fixtures.convert_helpers import TINY_CONFIGS, greedy, hf_greedy, hf_logits, make_hf_model

from mlx_tfm.families import ARCHITECTURES
from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

PROMPT = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42, 11]  # longer than the sliding windows
QUIET = dict(log=lambda *_: None)


def our_logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_every_table_entry_has_a_parity_case():
    covered = {TINY_CONFIGS[name].get("model_type", name) for name in TINY_CONFIGS}
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


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
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
    # mlx-lm's gemma runs exact GELU where transformers (and we) use the tanh form.
    atol = 2e-3 if name == "gemma" else 1e-4
    np.testing.assert_allclose(our_logits(ours, short), our_logits(theirs, short), atol=atol, rtol=0)


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
