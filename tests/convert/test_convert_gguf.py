"""GGUF against transformers' own GGUF reader (an independent implementation of
llama.cpp's conventions): Llama with a SentencePiece vocab and with Llama-3-style
byte-level BPE, Qwen2 with biases and Qwen2's pre-tokenizer, quantized blocks included.
Each further family written as llama.cpp's converter writes it gives transformers' logits;
every pre-tokenizer name we read splits text as llama.cpp's own regexes do. Mixtures of
experts (qwen3moe, Mixtral as a llama with experts, stacked or one tensor per expert,
quantized experts) give transformers' logits too."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from conftest import data_path
from fixtures.cli_runs import convert_error
from fixtures.convert_helpers import (
    TINY_CONFIGS,
    greedy,
    half_split_to_interleaved,
    hf_greedy,
    hf_logits,
    llama_cpp_hparams,
    make_hf_model,
    stories_llama2c_tensors,
    train_byte_level_bpe,
    transformers_from_gguf,
    write_hf_gguf,
    write_llama_cpp_gguf,
    write_stories_gguf,
)
from fixtures.gguf_names import llama_cpp_tensor_names, tiny_model_tensor_names

import mlx_tfm
from mlx_tfm.convert.converter import convert
from mlx_tfm.convert.gguf_file import GGUF_ARCHITECTURES, gguf_name, hf_name
from mlx_tfm.convert.gguf_hybrids import HYBRID_ARCHITECTURES
from mlx_tfm.convert.gguf_qwen_next import QWEN_NEXT_ARCHITECTURES
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

    from mlx_lm import (
        load as mlx_lm_load,  # transformers reads our tokenizer.json the same way
    )

    _, theirs = mlx_lm_load(str(tmp_path / "out"))
    assert theirs.encode(text, add_special_tokens=False) == ours


def test_unsupported_gguf_pre_tokenizer(tmp_path, bpe, capsys):
    tokens, _, eot = bpe
    make_hf_model("llama", tmp_path / "hf", vocab_size=len(tokens))
    write_hf_gguf(tmp_path / "hf", tmp_path / "model.gguf", bpe_writer(bpe, "bloom"))
    capsys.readouterr()  # transformers' progress bars
    err = convert_error(capsys, "--hf-path", tmp_path / "model.gguf", "--mlx-path", tmp_path / "out")
    assert "pre-tokenizer 'bloom' is not supported" in err and "llama-bpe" in err and "smollm" in err


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


# -- tensor names: one table, read both ways ---------------------------------------------------


# GGUF architecture -> the TINY_CONFIGS case whose tensors its files hold: each tensor of
# that tiny model that gguf's TensorNameMap names must be one we read.
TINY_CASE_OF_GGUF_ARCH = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text",
    "olmo2": "olmo2", "starcoder2": "starcoder2", "granite": "granite", "smollm3": "smollm3", "phi2": "phi",
    "deepseek2": "deepseek_v3", "glm4": "glm4", "ernie4_5": "ernie4_5", "nemotron": "nemotron",
    "hunyuan-dense": "hunyuan_v1_dense", "granitemoe": "granitemoeshared", "ernie4_5-moe": "ernie4_5_moe",
    "gemma": "gemma", "gemma2": "gemma2", "qwen2moe": "qwen2_moe", "command-r": "cohere", "olmoe": "olmoe",
    "arcee": "arcee", "phi3": "phi3", "seed_oss": "seed_oss", "exaone4": "exaone4", "glm4moe": "glm4_moe",
    "stablelm": "stablelm", "minimax-m2": "minimax_m2",
    # -- gguf_qwen_next.py (on main) --
    "qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",
    # -- gguf_families.py --
    "gptneox": "gpt_neox", "cohere2": "cohere2", "llama4": "llama4_text", "gemma4": "gemma4_text", "apertus": "apertus",
    # -- gguf_more_families.py --
    "gpt-oss": "gpt_oss", "gpt2": "gpt2", "starcoder": "gpt_bigcode", "gptj": "gptj", "phimoe": "phimoe",
    "exaone": "exaone", "exaone-moe": "exaone_moe", "dots1": "dots1", "hunyuan-moe": "hunyuan_v1_moe",
    "mistral3": "ministral3", "nemotron_h_moe": "nemotron_h_moe", "kimi-linear": "kimi_linear",
}


# the hybrids are checked in test_convert_gguf_hybrids.py and test_convert_gguf_qwen_next.py,
# the encoders (no causal-LM model to name the tensors of) in test_convert_gguf_more_families.py
ENCODER_ARCHS = {"bert", "t5"}


@pytest.mark.parametrize("arch", sorted(set(GGUF_ARCHITECTURES) - set(HYBRID_ARCHITECTURES) - set(QWEN_NEXT_ARCHITECTURES)
                                        - ENCODER_ARCHS))
def test_gguf_names_are_the_inverse_of_hf_names_and_llama_cpps(arch):
    """Writing (gguf_name) undoes reading (hf_name) for every tensor llama.cpp names, and
    gives the name gguf's own TensorNameMap gives the Hugging Face name (where it has it);
    every tensor of the architecture's tiny model that llama.cpp names is one we read."""
    import gguf

    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    theirs = gguf.get_tensor_name_map(model_arch, 4)
    ours = {name: hf_name(name, arch) for name in llama_cpp_tensor_names(arch)}
    read = {name: hf for name, hf in ours.items() if hf != name}  # the tensors we read
    assert arch in TINY_CASE_OF_GGUF_ARCH, f"{arch}: name its TINY_CONFIGS case"
    case = TINY_CASE_OF_GGUF_ARCH[arch]
    held = tiny_model_tensor_names(arch, {"model_type": case, **TINY_CONFIGS[case]})
    assert held and not held - set(read), sorted(held - set(read))
    for name, hf in read.items():
        assert gguf_name(hf, arch) == name
        assert theirs.get_name(hf, try_suffixes=(".weight", ".bias")) in (None, name), hf


def test_gguf_name_of_a_tensor_llama_cpp_has_no_name_for():
    with pytest.raises(ValueError, match="model.layers.0.mlp.c_fc.weight has no GGUF name in llama.cpp's llama"):
        gguf_name("model.layers.0.mlp.c_fc.weight", "llama")


# -- families as llama.cpp's converter writes them ------------------------------------------

# TINY_CONFIGS name -> (overrides that match what llama.cpp assumes of the family, the
# pre-tokenizer its converter would name). llama.cpp's Gemma 3 makes every 6th layer global
# with local base 10000 and scales by 1/sqrt(head_dim); its SmolLM 3 leaves every 4th layer
# unrotated; its StarCoder 2 files carry no sliding window.
LLAMA_CPP_CASES = {
    # YaRN as llama.cpp writes it (type, factor, original context) on a permuted Llama
    "llama": (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                    "rope_theta": 10000.0}), "llama-bpe"),
    "qwen3": ({}, "qwen2"),
    "gemma3_text": (dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
    }), "gpt-2"),
    "olmo2": ({}, "olmo"),
    "olmo3": ({}, "dbrx"),
    "starcoder2": (dict(sliding_window=None), "starcoder"),
    "granite": ({}, "refact"),
    "smollm3": (dict(no_rope_layer_interval=4), "llama-bpe"),
    "phi": (dict(num_key_value_heads=4), "phi-2"),  # Phi2Model writes head_count_kv = head_count
    # -- more families --
    "ernie4_5": ({}, "llama-bpe"),
    "nemotron": ({}, "gpt-2"),  # LayerNorm1P's weights stored plus 1, half of each head rotated
    "hunyuan_v1_dense": ({}, "llama-bpe"),  # NTK-alpha folded into the base
}
# transformers' GGUF reader as a second reference where it reads the file right (for Gemma 3
# it drops the rope scaling and query_pre_attn_scalar, for Qwen 3 the head size).
TRANSFORMERS_READS_GGUF = ("starcoder2",)


def llama_cpp_family_gguf(name, tmp_path, bpe, matrix_type="F32"):
    overrides, pre = LLAMA_CPP_CASES[name]
    tokens, _, eot = bpe
    hf = make_hf_model(name, tmp_path / "hf", vocab_size=len(tokens), bos_token_id=eot, eos_token_id=eot,
                       pad_token_id=eot, **overrides)
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "model.gguf", bpe_writer(bpe, pre), matrix_type)
    return hf


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_CASES))
def test_family_gguf_matches_transformers(name, tmp_path, bpe):
    hf = llama_cpp_family_gguf(name, tmp_path, bpe)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == hf.config.model_type
    reference = hf_logits(hf, IDS)
    np.testing.assert_allclose(our_logits(tmp_path / "out", IDS), reference, atol=1e-4, rtol=0)
    model, _ = mlx_tfm.load(tmp_path / "out")
    assert greedy(model, IDS, 8) == hf_greedy(hf, IDS, 8)
    if name in TRANSFORMERS_READS_GGUF:
        theirs, _ = transformers_from_gguf(tmp_path / "model.gguf")
        np.testing.assert_allclose(hf_logits(theirs, IDS), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["granite", "gemma3_text"])  # permuted q/k rows; norms stored as 1 + w
def test_family_gguf_q8_0_blocks(name, tmp_path, bpe):
    hf = llama_cpp_family_gguf(name, tmp_path, bpe, "Q8_0")
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    reference = hf_logits(hf, IDS)
    assert np.abs(our_logits(tmp_path / "out", IDS) - reference).max() < 0.05 * np.abs(reference).max()


def test_unsupported_gguf_rope_scaling(tmp_path, bpe, capsys):
    """A scaling we do not compute is one line, not a model rotating wrongly."""
    import gguf

    tokens, _, _ = bpe
    make_hf_model("qwen3", tmp_path / "hf", vocab_size=len(tokens))
    real_writer = gguf.GGUFWriter.add_rope_freq_base

    def with_longrope(writer, value):
        real_writer(writer, value)
        writer.add_string("qwen3.rope.scaling.type", "longrope")

    gguf.GGUFWriter.add_rope_freq_base = with_longrope
    try:
        write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "model.gguf", bpe_writer(bpe, "qwen2"))
    finally:
        gguf.GGUFWriter.add_rope_freq_base = real_writer
    capsys.readouterr()
    err = convert_error(capsys, "--hf-path", tmp_path / "model.gguf", "--mlx-path", tmp_path / "out")
    assert "rope scaling 'longrope' is not supported" in err


def test_qwen3moe_gguf_config_as_transformers_reads_it(tmp_path):
    """The expert counts and sizes of a Qwen3-MoE GGUF, against transformers' GGUF reader."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from mlx_tfm.convert.gguf_file import hf_config, metadata, open_reader

    writer = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "qwen3moe")
    for add, value in [("add_block_count", 2), ("add_context_length", 128), ("add_embedding_length", 64),
                       ("add_feed_forward_length", 128), ("add_head_count", 4), ("add_head_count_kv", 2),
                       ("add_key_length", 16), ("add_value_length", 16), ("add_rope_freq_base", 1e6),
                       ("add_layer_norm_rms_eps", 1e-6), ("add_expert_count", 8), ("add_expert_used_count", 2),
                       ("add_expert_feed_forward_length", 32)]:
        getattr(writer, add)(value)
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_reader(tmp_path / "moe.gguf")
    ours = hf_config(metadata(reader), {t.name: t for t in reader.tensors}, "qwen3moe")
    theirs = load_gguf_checkpoint(str(tmp_path / "moe.gguf"))["config"]
    assert ours["model_type"] == theirs["model_type"] == "qwen3_moe"
    for key in ("num_experts", "num_experts_per_tok", "head_dim", "num_key_value_heads"):
        assert ours[key] == theirs[key], key
    assert ours["moe_intermediate_size"] == 32  # transformers' reader leaves it out


# -- pre-tokenizers: our tokenizer.json splits as llama.cpp's regexes do -----------------------

# llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe): each pre-tokenizer type's regex list.
# Where llama.cpp rewrote a tokenizer.json regex for its own engine, the original it records
# beside it is used (the family's own split); the rest are llama.cpp's.
LLAMA_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_SPLITS = {
    "LLAMA3": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "STARCODER": [r"\p{N}", LLAMA_CPP_GPT2],  # also REFACT, COMMAND_R, SMOLLM, MINERVA
    "GPT2": [LLAMA_CPP_GPT2],  # also OLMO, and EXAONE4 / PHI-2 / MELLUM... by name
    "QWEN2": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+"],
    "QWEN35": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "TEKKEN": [r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
               r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "GPT4O": [r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "SEED_CODER": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+"],
    "DEEPSEEK_CODER": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "DEFAULT": [r"[\p{P}\$\+<=>\^~\|]+", LLAMA_CPP_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
# llama-vocab.cpp (llama_vocab::impl::load): tokenizer.ggml.pre -> pre-tokenizer type.
LLAMA_CPP_PRE_TYPES = {
    "default": "DEFAULT",
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "midm-2.0", "dbrx", "smaug-bpe"],
                    "LLAMA3"),
    "deepseek-coder": "DEEPSEEK_CODER",
    **dict.fromkeys(["starcoder", "refact", "command-r", "smollm", "minerva-7b"], "STARCODER"),
    **dict.fromkeys(["gpt-2", "phi-2", "a.x-4.0", "mellum", "olmo", "exaone4", "trillion"], "GPT2"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez"], "QWEN2"),
    "qwen35": "QWEN35",
    "tekken": "TEKKEN",
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2"], "GPT4O"),
    "seed-coder": "SEED_CODER",
    "gpt2": "GPT2",  # not a llama.cpp name: files from older tools
}
# llama.cpp's own check text (convert_hf_to_gguf_update.py CHK_TXT), then harder cases.
SPLIT_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= "
    "нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure "
    "I'll make it, 'D you like some tea? We'Ve a'lL"
    " CamelCaseWord HTTPServer iPhone naïve cafe\u0301 ÉTÉ 1,000,000 3.14159 don'T x//y\n\n\tdef f(x):\n        return x**2  "
)


@pytest.fixture(scope="module")
def bpe_across_boundaries(shakespeare):
    """A byte-level BPE trained on whole paragraphs, so its merges span the places where
    pre-tokenizers differ (digits, spaces, punctuation, case): the splits then show in ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    paragraphs = ["\n".join(shakespeare[i : i + 4]) for i in range(0, 4000, 4)]  # newlines inside, as in the text
    tokenizer.train_from_iterator(paragraphs + [SPLIT_TEXT] * 20, trainer)
    model_json = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model_json["vocab"], key=model_json["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model_json["merges"]]
    return tokens, merges, tokenizer.token_to_id("<|endoftext|>")


def bpe_metadata(bpe, pre: str) -> dict:
    tokens, merges, eot = bpe
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": [3 if i == eot else 1 for i in range(len(tokens))],
            "tokenizer.ggml.bos_token_id": eot, "tokenizer.ggml.eos_token_id": eot}


def llama_cpp_split_tokenizer(bpe, regexes: list[str]):
    """The same vocabulary split as llama.cpp splits: each regex in turn, then bytes."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tokens, merges, _ = bpe
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), "isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tokenizer


def our_gguf_tokenizer(bpe, pre: str, tmp_path):
    from tokenizers import Tokenizer

    from mlx_tfm.convert.gguf_file import byte_level_bpe_tokenizer

    return Tokenizer.from_str(byte_level_bpe_tokenizer(bpe_metadata(bpe, pre), tmp_path)["tokenizer.json"].decode())


def test_every_pre_tokenizer_has_llama_cpp_reference():
    from mlx_tfm.convert.gguf_file import PRE_TOKENIZERS

    assert set(PRE_TOKENIZERS) == set(LLAMA_CPP_PRE_TYPES)


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_PRE_TYPES))
def test_pre_tokenizer_splits_as_llama_cpp(pre, bpe_across_boundaries, shakespeare, tmp_path):
    text = SPLIT_TEXT + "\n".join(shakespeare[6000:6040])
    ours = our_gguf_tokenizer(bpe_across_boundaries, pre, tmp_path)
    reference = llama_cpp_split_tokenizer(bpe_across_boundaries, LLAMA_CPP_SPLITS[LLAMA_CPP_PRE_TYPES[pre]])
    assert ours.encode(text).ids == reference.encode(text).ids


def test_pre_tokenizer_types_tell_apart_on_the_text(bpe_across_boundaries, tmp_path):
    """The check above can fail: on this text and vocabulary each name's ids differ from
    those of every llama.cpp type but its own, so a name mapped to the wrong type would show."""
    references = {kind: llama_cpp_split_tokenizer(bpe_across_boundaries, regexes).encode(SPLIT_TEXT).ids
                  for kind, regexes in LLAMA_CPP_SPLITS.items()}
    for pre, own_kind in LLAMA_CPP_PRE_TYPES.items():
        ours = our_gguf_tokenizer(bpe_across_boundaries, pre, tmp_path).encode(SPLIT_TEXT).ids
        wrong = [kind for kind, ids in references.items() if kind != own_kind and ids == ours]
        assert not wrong, f"{pre} splits as {wrong} too"


def test_smollm_gguf_tokenizes_as_smollm(tmp_path, bpe, shakespeare):
    """The GGUF of our own default hub model's family (pre-tokenizer ``smollm``) loads, and
    its tokenizer splits as SmolLM's tokenizer.json does: each digit apart, then GPT-2's regex."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokens, merges, eot = bpe
    make_hf_model("llama3", tmp_path / "hf", vocab_size=len(tokens), bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    write_hf_gguf(tmp_path / "hf", tmp_path / "model.gguf", bpe_writer(bpe, "smollm"))
    _, tokenizer = mlx_tfm.load(tmp_path / "model.gguf")
    smollm = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges]))
    smollm.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    text = SPLIT_TEXT + "\n".join(shakespeare[7000:7020])
    assert tokenizer.encode(text, add_special_tokens=False) == smollm.encode(text).ids


# -- SentencePiece vocabularies (Llama 2, Gemma, Mistral v1-v3) ------------------------------


@pytest.fixture(scope="module")
def gemma_style_spm(tmp_path_factory, shakespeare):
    """A SentencePiece BPE trained here as Gemma's is: no dummy prefix, byte fallback,
    turn markers as user-defined pieces, Gemma's special ids (pad 0, eos 1, bos 2, unk 3)."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("spm")
    (folder / "corpus.txt").write_text("\n".join(shakespeare[:5000]))
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "gemma"), vocab_size=600, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        split_digits=True, minloglevel=2,
    )
    return folder / "gemma.model"


def spm_writer(model_path, add_space_prefix: bool):
    """The vocabulary as llama.cpp's _set_vocab_sentencepiece writes it (Gemma 3: no space prefix)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))

    def kind(i):
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i).startswith("<") and sp.id_to_piece(i).endswith(">") else 1  # user-defined

    def add_tokenizer(writer):
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
        writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
        writer.add_token_types([kind(i) for i in range(sp.get_piece_size())])
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_space_prefix(add_space_prefix)

    return add_tokenizer


def test_gemma_style_sentencepiece_gguf(tmp_path, gemma_style_spm, shakespeare):
    import sentencepiece as spm

    make_hf_model("gemma3_text", tmp_path / "hf", vocab_size=600, **LLAMA_CPP_CASES["gemma3_text"][0])
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "model.gguf", spm_writer(gemma_style_spm, add_space_prefix=False))
    _, tokenizer = mlx_tfm.load(tmp_path / "model.gguf")
    sp = spm.SentencePieceProcessor(model_file=str(gemma_style_spm))
    text = "<start_of_turn>user\n" + "\n".join(shakespeare[8000:8030]) + " 12345 naïve 🦙<end_of_turn>\n"
    assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text)


# -- mixtures of experts as llama.cpp writes them ---------------------------------------------

# model_type -> (overrides that match what llama.cpp assumes of the family, pre-tokenizer).
# llama.cpp's qwen3moe makes every layer a mixture and always renormalises the chosen
# experts; its Mixtral is a llama with expert_count set.
MOE_CASES = {
    "qwen3_moe": (dict(decoder_sparse_step=1, norm_topk_prob=True), "qwen2"),
    "mixtral": ({}, "llama-bpe"),
}
HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def llama_cpp_moe_tensors(config: dict, weights: dict, one_per_expert: bool) -> dict[str, np.ndarray]:
    """A Qwen3-MoE or Mixtral checkpoint's tensors in llama.cpp's names and layout, as its
    converter makes them (Qwen2MoeModel / LlamaModel.modify_tensors): each projection's
    experts stacked (experts, out, in) under the merged name the gguf name map knows
    (older converters: one tensor per expert, ``blk.N.ffn_gate.E.weight``); Mixtral's q/k
    rows permuted as any llama's."""
    import gguf

    mixtral = config["model_type"] == "mixtral"
    arch = gguf.MODEL_ARCH.LLAMA if mixtral else gguf.MODEL_ARCH.QWEN3MOE
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors, experts = {}, {}
    for name, w in weights.items():
        if match := HF_EXPERT.fullmatch(name):
            layer, expert, projection = match.groups()
            experts.setdefault((layer, projection), {})[int(expert)] = w
            continue
        if mixtral and name.endswith("self_attn.q_proj.weight"):
            w = half_split_to_interleaved(w, config["num_attention_heads"])
        if mixtral and name.endswith("self_attn.k_proj.weight"):
            w = half_split_to_interleaved(w, config["num_key_value_heads"])
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = w
    for (layer, projection), per_expert in experts.items():
        merged = f"layers.{layer}.feed_forward.experts.{projection}" if mixtral else \
            f"model.layers.{layer}.mlp.experts.{projection}"
        gguf_name = names.get_name(merged)  # blk.N.ffn_gate_exps
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])  # (experts, out, in)
        if one_per_expert:
            tensors.update({f"{gguf_name.removesuffix('_exps')}.{e}.weight": w for e, w in enumerate(stacked)})
        else:
            tensors[f"{gguf_name}.weight"] = stacked
    return tensors


def write_moe_gguf(hf_folder, path, add_tokenizer, expert_type="F32", one_per_expert=False, edit=None) -> None:
    """A Hugging Face Qwen3-MoE or Mixtral folder as llama.cpp's converter writes it, the
    experts in ``expert_type`` blocks; ``edit(tensors)`` spoils the file for error tests."""
    import gguf

    config = json.loads((hf_folder / "config.json").read_text())
    mixtral = config["model_type"] == "mixtral"
    writer = gguf.GGUFWriter(str(path), "llama" if mixtral else "qwen3moe")
    llama_cpp_hparams(writer, config)
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])  # transformers 5 saves either
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if not mixtral:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_tokenizer(writer)
    weights = {name: np.array(t, dtype=np.float32) for name, t in mx.load(str(hf_folder / "model.safetensors")).items()}
    tensors = llama_cpp_moe_tensors(config, weights, one_per_expert)
    for name, w in (edit(tensors) if edit else tensors).items():
        is_expert = "_exps." in name or re.fullmatch(r"blk\.\d+\.ffn_\w+\.\d+\.weight", name)
        if is_expert and expert_type != "F32":
            qtype = gguf.GGMLQuantizationType[expert_type]
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def moe_gguf(name, tmp_path, bpe, **write_options):
    overrides, pre = MOE_CASES[name]
    tokens, _, eot = bpe
    hf = make_hf_model(name, tmp_path / "hf", vocab_size=len(tokens), bos_token_id=eot, eos_token_id=eot,
                       pad_token_id=eot, **overrides)
    write_moe_gguf(tmp_path / "hf", tmp_path / "model.gguf", bpe_writer(bpe, pre), **write_options)
    return hf


def transformers_reads_qwen3moe_gguf(path, moe_intermediate_size: int):
    """transformers' GGUF reader, an independent reading of llama.cpp's stacked experts; its
    config reader leaves out the experts' size (test_qwen3moe_gguf_config_as_transformers_reads_it)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = {**load_gguf_checkpoint(str(path))["config"], "moe_intermediate_size": moe_intermediate_size}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).float().eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


@pytest.mark.parametrize("name,one_per_expert", [("qwen3_moe", False), ("mixtral", False), ("mixtral", True)])
def test_moe_gguf_matches_transformers(name, one_per_expert, tmp_path, bpe):
    hf = moe_gguf(name, tmp_path, bpe, one_per_expert=one_per_expert)
    convert(tmp_path / "model.gguf", tmp_path / "out", **QUIET)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == name
    reference = hf_logits(hf, IDS)
    np.testing.assert_allclose(our_logits(tmp_path / "out", IDS), reference, atol=1e-4, rtol=0)
    model, _ = mlx_tfm.load(tmp_path / "out")
    assert greedy(model, IDS, 8) == hf_greedy(hf, IDS, 8)
    if name == "qwen3_moe":  # the file's layout, read by transformers, is the model's
        theirs = transformers_reads_qwen3moe_gguf(tmp_path / "model.gguf", hf.config.moe_intermediate_size)
        np.testing.assert_allclose(hf_logits(theirs, IDS), reference, atol=1e-4, rtol=0)


def dequantized_experts(path) -> dict[str, np.ndarray]:
    """gguf's own decoding of every expert tensor of a file, one-per-expert ones stacked:
    {``blk.N.ffn_gate`` ...: (experts, out, in)}."""
    import gguf

    parts: dict[str, dict[int, np.ndarray]] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        stacked = re.fullmatch(r"(blk\.\d+\.ffn_\w+)_exps\.weight", t.name)
        single = re.fullmatch(r"(blk\.\d+\.ffn_\w+)\.(\d+)\.weight", t.name)
        if stacked:
            parts.setdefault(stacked[1], {}).update(enumerate(gguf.quants.dequantize(t.data, t.tensor_type)))
        elif single:
            parts.setdefault(single[1], {})[int(single[2])] = gguf.quants.dequantize(t.data, t.tensor_type)
    return {name: np.stack([experts[e] for e in sorted(experts)]) for name, experts in parts.items()}


def set_hf_experts(hf, experts: dict[str, np.ndarray]) -> None:
    """The transformers model's experts replaced by ``experts`` (transformers 5 holds them
    fused: gate_up_proj (experts, 2F, D), gate rows first; down_proj (experts, D, F))."""
    import torch

    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            gate_up = np.concatenate([experts[f"blk.{i}.ffn_gate"], experts[f"blk.{i}.ffn_up"]], axis=1)
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(experts[f"blk.{i}.ffn_down"]))


OUR_EXPERTS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


@pytest.mark.parametrize("name,kind,one_per_expert", [
    ("qwen3_moe", "Q8_0", False), ("qwen3_moe", "Q4_0", False), ("mixtral", "Q4_1", False), ("mixtral", "Q8_0", True),
])
def test_moe_gguf_quantized_experts_stay_exact(name, kind, one_per_expert, tmp_path, bpe):
    """Q8_0 / Q4_0 / Q4_1 experts are carried over as MLX groups that dequantize to exactly
    gguf's decoding, and the model computes what transformers computes with those experts."""
    hf = moe_gguf(name, tmp_path, bpe, expert_type=kind, one_per_expert=one_per_expert)
    convert(tmp_path / "model.gguf", tmp_path / "out", dtype="float32", **QUIET)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    bits = config["quantization"]["bits"]
    assert (bits, config["quantization"]["group_size"]) == (8 if kind == "Q8_0" else 4, 32)
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    ours = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    experts = dequantized_experts(tmp_path / "model.gguf")
    assert len(experts) == 3 * hf.config.num_hidden_layers
    for llama_cpp_name, reference in experts.items():
        layer, projection = llama_cpp_name.split(".")[1], OUR_EXPERTS[llama_cpp_name.split(".")[2]]
        base = f"model.layers.{layer}.{block}.switch_mlp.{projection}"
        dequantized = mx.dequantize(ours[f"{base}.weight"], ours[f"{base}.scales"], ours[f"{base}.biases"],
                                    group_size=32, bits=bits)
        np.testing.assert_array_equal(np.array(dequantized), reference)
    set_hf_experts(hf, experts)
    np.testing.assert_allclose(our_logits(tmp_path / "out", IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def without(name: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


def first_three_experts_of(name: str):
    return lambda tensors: {**tensors, name: tensors[name][:3]}


@pytest.mark.parametrize("one_per_expert,edit,message", [
    (False, without("blk.1.ffn_down_exps.weight"), "lacks blk.1.ffn_down_exps.weight"),
    (False, first_three_experts_of("blk.0.ffn_up_exps.weight"),
     "blk.0.ffn_up_exps.weight holds 3 experts, the metadata says 4"),
    (True, without("blk.0.ffn_up.2.weight"), "lacks blk.0.ffn_up.2.weight"),
])
def test_moe_gguf_missing_expert_is_one_line(one_per_expert, edit, message, tmp_path, bpe, capsys):
    moe_gguf("mixtral", tmp_path, bpe, one_per_expert=one_per_expert, edit=edit)
    capsys.readouterr()
    err = convert_error(capsys, "--hf-path", tmp_path / "model.gguf", "--mlx-path", tmp_path / "out")
    assert message in err, err


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_mapping_of_stacked_experts_is_exact(kind):
    """(experts, out, bytes) blocks -> MLX (experts, out, ...) arrays, per row as a matrix's."""
    import gguf

    from mlx_tfm.convert.gguf_file import to_mlx_quantized

    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(1).standard_normal((3, 8, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)  # (3, 8, bytes)
    packed, scales, biases = to_mlx_quantized(kind, blocks)
    assert packed.shape[:2] == scales.shape[:2] == biases.shape[:2] == (3, 8)
    ours = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32,
                         bits=8 if kind == "Q8_0" else 4)
    np.testing.assert_array_equal(np.array(ours), gguf.quants.dequantize(blocks, qtype))
