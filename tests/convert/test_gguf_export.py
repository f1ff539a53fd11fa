"""GGUF export: our file read by transformers' own GGUF loader (modelled on llama.cpp's
conventions: its names, permuted q/k rows, tied head) gives the source model's logits, its
blocks are the ``gguf`` package's reference quantizer's, and it reads back into ours."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from fixtures.cli_runs import convert_error
from fixtures.convert_helpers import hf_logits, make_hf_model, transformers_from_gguf
from fixtures.tokenizer_folders import byte_level_folder

import mlx_tfm
from mlx_tfm.convert.converter import convert
from mlx_tfm.cli import main
from mlx_tfm.convert.gguf_export import export_gguf, pre_tokenizer_name
from mlx_tfm.convert.gguf_file import PRE_TOKENIZERS, byte_level_pre_tokenizer
from mlx_tfm.errors import UserError
from mlx_tfm.loading import load_model

QUIET = dict(log=lambda *_: None)


def our_logits(folder, ids) -> np.ndarray:
    model, _ = load_model(folder)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def gguf_tensors(path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def rounded_as(kind: str, weights: dict) -> dict:
    """The source weights as a file of ``kind`` holds them, by gguf's own reference
    quantizer and decoder: matrices whose rows split into 32s in the type, other matrices
    in float16, vectors in float32."""
    import gguf

    out = {}
    for name, w in weights.items():
        w = np.array(w.astype(mx.float32))
        if w.ndim == 2 and kind in ("q8_0", "q4_0") and w.shape[1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        elif w.ndim == 2 and kind == "bf16":
            w = np.array(mx.array(w).astype(mx.bfloat16).astype(mx.float32))
        elif w.ndim == 2 and kind != "f32":
            w = w.astype(np.float16).astype(np.float32)
        out[name] = mx.array(w)
    return out


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_stories_export_reads_back_in_transformers_and_ours(kind, tmp_path, stories_hf, golden):
    path = export_gguf(stories_hf, tmp_path / "s.gguf", kind, **QUIET)
    ids = golden["prompt_ids"] + golden["generated_ids"][:40]
    reference, tokenizer = transformers_from_gguf(path)
    theirs = hf_logits(reference, ids)
    convert(path, tmp_path / "back", dtype="float32", **QUIET)
    np.testing.assert_allclose(our_logits(tmp_path / "back", ids), theirs, atol=1e-4, rtol=0)
    source, _ = load_model(stories_hf)
    source.load_weights(list(rounded_as(kind, mx.load(str(stories_hf / "model.safetensors"))).items()))
    np.testing.assert_allclose(np.array(source(mx.array([ids]))[0]), theirs, atol=1e-4, rtol=0)
    if kind in ("f32", "f16"):  # the golden text's first 40 tokens survive these roundings
        assert list(theirs.argmax(-1)[:-1]) == ids[1:]
    text = golden["prompt_encode_example"]["text"]
    assert tokenizer.encode(text, add_special_tokens=False) == golden["prompt_encode_example"]["sp_encode_no_bos"]


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_are_the_reference_quantizers(kind, tmp_path, stories_hf):
    """Each matrix's blocks are byte for byte what gguf's quantizer makes of the source
    matrix (q/k rows in llama.cpp's order); rows that do not split into 32s stay F16."""
    import gguf

    path = export_gguf(stories_hf, tmp_path / "s.gguf", kind, **QUIET)
    tensors = gguf_tensors(path)
    source = mx.load(str(stories_hf / "model.safetensors"))
    up = np.array(source["model.layers.0.mlp.up_proj.weight"])  # (172, 64): rows of 64 quantize
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    assert tensors["blk.0.ffn_up.weight"].tensor_type == qtype
    np.testing.assert_array_equal(np.array(tensors["blk.0.ffn_up.weight"].data), gguf.quants.quantize(up, qtype))
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "F16"  # its rows are 172 long
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert "output.weight" not in tensors  # the tied head: llama.cpp reuses token_embd


def test_metadata_llama_cpp_requires(tmp_path, stories_hf):
    import gguf

    config = json.loads((stories_hf / "config.json").read_text())
    fields = gguf.GGUFReader(str(export_gguf(stories_hf, tmp_path / "s.gguf", "f16", **QUIET))).fields
    value = lambda key: fields[key].contents()  # noqa: E731
    assert value("general.architecture") == "llama"
    assert value("general.file_type") == 1  # LLAMA_FTYPE_MOSTLY_F16
    expected = {"llama.block_count": config["num_hidden_layers"], "llama.embedding_length": config["hidden_size"],
                "llama.feed_forward_length": config["intermediate_size"],
                "llama.attention.head_count": config["num_attention_heads"],
                "llama.attention.head_count_kv": config["num_key_value_heads"],
                "llama.rope.dimension_count": config["head_dim"], "llama.context_length": 512,
                "tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    assert {key: value(key) for key in expected} == expected
    assert value("llama.rope.freq_base") == pytest.approx(config["rope_theta"])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_byte_level_bpe_families_export(family, tmp_path):
    """Qwen 2 / 3 with a byte-level BPE tokenizer: unpermuted q/k, biases (2), q/k norms and
    head_dim apart from hidden / heads (3), an untied head, GPT-2's split named as llama.cpp
    names it, the merges and special tokens. transformers' GGUF loader ignores key_length,
    so Qwen 3 is read back by ours only."""
    import gguf

    folder = tmp_path / "hf"
    make_hf_model(family, folder, vocab_size=300, tie_word_embeddings=False)
    tokenizer_folder = byte_level_folder(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    path = export_gguf(folder, tmp_path / "q.gguf", "f32", **QUIET)
    assert gguf.GGUFReader(str(path)).fields["tokenizer.ggml.pre"].contents() == "gpt-2"  # llama.cpp refuses "gpt2" (unknown pre-tokenizer type)
    ids = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 120, 45]
    convert(path, tmp_path / "back", **QUIET)
    np.testing.assert_allclose(our_logits(tmp_path / "back", ids), our_logits(folder, ids), atol=1e-4, rtol=0)
    _, ours = mlx_tfm.load(folder)
    _, back = mlx_tfm.load(tmp_path / "back")
    text = "Once upon a time <|im_end|> 你好世界 café! It's 2024, x//y.\n\tdef f(x): return x**2"
    assert back.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    if family == "qwen3":
        return
    reference, tokenizer = transformers_from_gguf(path)
    np.testing.assert_allclose(hf_logits(reference, ids), our_logits(folder, ids), atol=1e-4, rtol=0)
    assert tokenizer.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)


def test_the_probe_tells_every_llama_cpp_split_apart():
    """Each pre-tokenizer llama.cpp names is found again from its own splitting: names that
    come back as another one split exactly alike (the same steps)."""
    from tokenizers import Tokenizer, models

    for name, steps in PRE_TOKENIZERS.items():
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = byte_level_pre_tokenizer(name, None)
        assert PRE_TOKENIZERS[pre_tokenizer_name(tokenizer)] == steps, name


def test_llama3_rope_scaling_travels_as_rope_freqs(tmp_path, stories_hf):
    """Llama 3.x's scaling becomes llama.cpp's per-frequency factors; transformers' GGUF
    loader and ours read it back to the source's logits."""
    import gguf

    folder = tmp_path / "llama3"
    shutil.copytree(stories_hf, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}  # short, so the band covers several pairs
    (folder / "config.json").write_text(json.dumps(config))
    path = export_gguf(folder, tmp_path / "l3.gguf", "f32", **QUIET)
    factors = np.array(gguf_tensors(path)["rope_freqs.weight"].data)
    assert factors.shape == (4,) and factors.max() == pytest.approx(8.0) and factors.min() == 1.0
    ids = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298] * 6  # 66 positions, past the original 64
    convert(path, tmp_path / "back", **QUIET)
    np.testing.assert_allclose(our_logits(tmp_path / "back", ids), our_logits(folder, ids), atol=1e-4, rtol=0)


def test_quantized_mlx_folder_exports_its_dequantized_weights(tmp_path, stories_hf):
    convert(stories_hf, tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32, **QUIET)
    path = export_gguf(tmp_path / "q8", tmp_path / "s.gguf", "f32", **QUIET)
    ids = [1, 403, 407, 261, 378]
    reference, _ = transformers_from_gguf(path)
    np.testing.assert_allclose(hf_logits(reference, ids), our_logits(tmp_path / "q8", ids), atol=1e-4, rtol=0)


def test_refusals_are_one_line(tmp_path, stories_hf):
    (tmp_path / "taken.gguf").write_bytes(b"x")
    with pytest.raises(UserError, match="already exists"):
        export_gguf(stories_hf, tmp_path / "taken.gguf", **QUIET)
    with pytest.raises(UserError, match="--gguf-type must be one of"):
        export_gguf(stories_hf, tmp_path / "s.gguf", "q5_k", **QUIET)
    make_hf_model("gemma", tmp_path / "gemma")
    with pytest.raises(UserError, match="GGUF export supports llama, mistral, qwen2, qwen3 models, not 'gemma'"):
        export_gguf(tmp_path / "gemma", tmp_path / "g.gguf", **QUIET)
    scaled = tmp_path / "scaled"
    shutil.copytree(stories_hf, scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    (scaled / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="rope scaling 'yarn'"):
        export_gguf(scaled, tmp_path / "y.gguf", **QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma", "scaled", "taken.gguf"]  # nothing half-written


def test_cli_convert_to_gguf(tmp_path, stories_hf, capsys):
    assert main(["convert", "--hf-path", str(stories_hf), "--to-gguf", str(tmp_path / "s.gguf"),
                 "--gguf-type", "q8_0"]) == 0
    assert gguf_tensors(tmp_path / "s.gguf")["blk.0.ffn_up.weight"].tensor_type.name == "Q8_0"
    assert "already exists" in convert_error(capsys, "--hf-path", stories_hf, "--to-gguf", tmp_path / "s.gguf")
    assert "not -q" in convert_error(capsys, "--hf-path", stories_hf, "--to-gguf", tmp_path / "t.gguf", "-q")


def test_fuse_export_gguf(tmp_path, stories_hf):
    """`fuse --export-gguf` (as mlx_lm.fuse): the fused model's GGUF gives its logits."""
    from mlx_tfm.model.lora import LoRALinear, apply_lora
    from mlx_tfm.weights.adapters import save_adapters

    model, _ = load_model(stories_hf)
    apply_lora(model, num_layers=2, fine_tune_type="lora", rank=4)
    for _, module in model.named_modules():  # nonzero B, so the adapters change the outputs
        if isinstance(module, LoRALinear):
            module.lora_b = 0.02 * mx.random.normal(module.lora_b.shape, key=mx.random.key(1))
    save_adapters(tmp_path / "adapters", model, {"fine_tune_type": "lora", "num_layers": 2,
                                                 "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}})
    ids = [1, 403, 407, 261, 378]
    expected = np.array(model(mx.array([ids]))[0])
    assert main(["fuse", "--model", str(stories_hf), "--adapter-path", str(tmp_path / "adapters"),
                 "--save-path", str(tmp_path / "fused"), "--export-gguf"]) == 0
    reference, _ = transformers_from_gguf(tmp_path / "fused" / "ggml-model-f16.gguf")
    np.testing.assert_allclose(hf_logits(reference, ids), expected, atol=2e-2, rtol=0)  # F16 rounding
