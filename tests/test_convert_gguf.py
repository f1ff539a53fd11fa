"""GGUF against transformers' own GGUF reader (an independent implementation of
llama.cpp's conventions): Llama with a SentencePiece vocab and with Llama-3-style
byte-level BPE, Qwen2 with biases and Qwen2's pre-tokenizer, quantized blocks included."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import data_path
from fixtures.cli_runs import convert_error
from fixtures.convert_helpers import (
    greedy,
    hf_greedy,
    hf_logits,
    make_hf_model,
    stories_llama2c_tensors,
    train_byte_level_bpe,
    transformers_from_gguf,
    write_hf_gguf,
    write_stories_gguf,
)

import mlx_tfm
from mlx_tfm.convert.converter import convert
from mlx_tfm.loading import load_model

QUIET = dict(log=lambda *_: None)
IDS = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 120, 45]


def our_logits(folder, ids) -> np.ndarray:
    model, _ = load_model(folder)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_0", "Q4_1"])
def test_stories_gguf_matches_transformers_gguf_reader(kind, tmp_path, stories_dir, stories_hf, golden):
    tensors, config = stories_llama2c_tensors(stories_hf)
    write_stories_gguf(tensors, config, stories_dir / "tok512.model", tmp_path / "s.gguf", kind)
    convert(tmp_path / "s.gguf", tmp_path / "out", dtype="float32", **QUIET)
    reference, reference_tokenizer = transformers_from_gguf(tmp_path / "s.gguf")
    ids = golden["prompt_ids"] + golden["generated_ids"][:40]
    np.testing.assert_allclose(our_logits(tmp_path / "out", ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    _, tokenizer = mlx_tfm.load(tmp_path / "out")
    assert tokenizer.encode(golden["text"], add_special_tokens=False) == reference_tokenizer.encode(
        golden["text"], add_special_tokens=False
    )


@pytest.fixture(scope="module")
def shakespeare() -> list[str]:
    return data_path("tinyshakespeare", "input.txt").read_text().splitlines()


@pytest.fixture(scope="module")
def bpe(shakespeare):
    """A byte-level BPE trained here, as GGUF metadata: (tokens, merges, end-of-text id)."""
    tokenizer = train_byte_level_bpe(shakespeare[:3000] + ["1234567 89 2024 3.14159"] * 50, vocab_size=300)
    model_json = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model_json["vocab"], key=model_json["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model_json["merges"]]
    return tokens, merges, tokenizer.token_to_id("<|endoftext|>")


def bpe_writer(bpe, pre: str):
    tokens, merges, eot = bpe

    def add_tokenizer(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([3 if i == eot else 1 for i in range(len(tokens))])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(eot)
        writer.add_eos_token_id(eot)

    return add_tokenizer


@pytest.mark.parametrize("arch,pre", [("llama", "gpt2"), ("llama", "llama-bpe"), ("qwen2", "qwen2")])
def test_byte_level_bpe_gguf(arch, pre, tmp_path, bpe, shakespeare):
    tokens, _, eot = bpe
    hf = make_hf_model(arch, tmp_path / "hf", vocab_size=len(tokens), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    write_hf_gguf(tmp_path / "hf", tmp_path / "model.gguf", bpe_writer(bpe, pre), arch=arch)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == arch

    reference, reference_tokenizer = transformers_from_gguf(tmp_path / "model.gguf")
    np.testing.assert_allclose(our_logits(tmp_path / "out", IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)
    np.testing.assert_allclose(our_logits(tmp_path / "out", IDS), hf_logits(reference, IDS), atol=1e-4, rtol=0)
    model, tokenizer = mlx_tfm.load(tmp_path / "out")
    assert greedy(model, IDS, 8) == hf_greedy(hf, IDS, 8)

    text = "\n".join(shakespeare[5000:5030]) + " In 1603, 12345 men's <|endoftext|> they'll  go"
    ours = tokenizer.encode(text, add_special_tokens=False)
    assert ours == reference_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ours) == text.replace(" <|endoftext|>", " ")  # specials are skipped in decode

    from mlx_lm import load as mlx_lm_load  # transformers reads our tokenizer.json the same way

    _, theirs = mlx_lm_load(str(tmp_path / "out"))
    assert theirs.encode(text, add_special_tokens=False) == ours


def test_unsupported_gguf_pre_tokenizer(tmp_path, bpe, capsys):
    tokens, _, eot = bpe
    make_hf_model("llama", tmp_path / "hf", vocab_size=len(tokens))
    write_hf_gguf(tmp_path / "hf", tmp_path / "model.gguf", bpe_writer(bpe, "tekken"))
    capsys.readouterr()  # transformers' progress bars
    err = convert_error(capsys, "--hf-path", tmp_path / "model.gguf", "--mlx-path", tmp_path / "out")
    assert "pre-tokenizer 'tekken' is not supported" in err and "llama-bpe" in err


@pytest.mark.parametrize(
    "kind,magnitude",
    # 3e4: the bias (-128 d, -8 d) overflows float16, so float32 scales are kept
    [("Q8_0", 1.0), ("Q4_0", 1.0), ("Q4_1", 1.0), ("Q8_0", 3e4), ("Q4_0", 3e4)],
)
def test_block_mapping_is_exact(kind, magnitude):
    import gguf

    from mlx_tfm.convert.gguf_file import to_mlx_quantized

    qtype = gguf.GGMLQuantizationType[kind]
    w = (np.random.default_rng(0).standard_normal((8, 96)) * magnitude).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    packed, scales, biases = to_mlx_quantized(kind, blocks)
    assert scales.dtype == (mx.float32 if magnitude > 1 else mx.float16)
    bits = 8 if kind == "Q8_0" else 4
    ours = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(ours), gguf.quants.dequantize(blocks, qtype))
