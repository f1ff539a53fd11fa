"""GGUF with a GPT-2-style byte-level BPE vocabulary (as llama.cpp writes SmolLM-like
Llamas): the weights convert exactly and the metadata becomes a tokenizer.json that
tokenizes like the original."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from conftest import data_path
from fixtures.convert_helpers import make_hf_model, train_byte_level_bpe, write_hf_llama_gguf

import mlx_tfm
from convert.converter import convert
from mlx_tfm.loading import load_model

QUIET = dict(log=lambda *_: None)


def test_gguf_byte_level_bpe(tmp_path):
    lines = data_path("tinyshakespeare", "input.txt").read_text().splitlines()
    tokenizer = train_byte_level_bpe(lines[:3000], vocab_size=300)
    model_json = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model_json["vocab"], key=model_json["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model_json["merges"]]
    eot = tokenizer.token_to_id("<|endoftext|>")

    def add_tokenizer(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if i == eot else 1 for i in range(len(tokens))])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(eot)
        writer.add_eos_token_id(eot)

    make_hf_model("llama", tmp_path / "hf", vocab_size=len(tokens), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    write_hf_llama_gguf(tmp_path / "hf", tmp_path / "model.gguf", add_tokenizer)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    convert(tmp_path / "hf", tmp_path / "reference", **QUIET)

    ours, _ = load_model(tmp_path / "out")
    reference, _ = load_model(tmp_path / "reference")
    ids = [5, 17, 200, 33, 9, 101, 64, 250, 3, 77]
    np.testing.assert_allclose(np.array(ours(mx.array([ids]))), np.array(reference(mx.array([ids]))), atol=1e-5, rtol=0)

    _, converted = mlx_tfm.load(tmp_path / "out")
    text = "\n".join(lines[5000:5040]) + " <|endoftext|>"
    assert converted.encode(text, add_special_tokens=False) == tokenizer.encode(text).ids
    assert converted.decode(tokenizer.encode("First Citizen:\nBefore we proceed").ids) == "First Citizen:\nBefore we proceed"

    from mlx_lm import load as mlx_lm_load  # transformers reads the same tokenizer.json

    _, theirs = mlx_lm_load(str(tmp_path / "out"))
    assert theirs.encode(text, add_special_tokens=False) == tokenizer.encode(text).ids


def test_unsupported_gguf_pre_tokenizer(tmp_path, capsys):
    from test_convert_errors import run_cli

    def add_tokenizer(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(["a", "b"])

    make_hf_model("llama", tmp_path / "hf")
    write_hf_llama_gguf(tmp_path / "hf", tmp_path / "model.gguf", add_tokenizer)
    capsys.readouterr()  # transformers' progress bars
    err = run_cli(capsys, "--hf-path", tmp_path / "model.gguf", "--mlx-path", tmp_path / "out")
    assert "pre-tokenizer 'qwen2' is not supported" in err
