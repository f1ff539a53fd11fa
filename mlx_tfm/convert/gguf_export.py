"""``export_gguf``: a Llama-family model (llama, mistral, qwen2, qwen3) as a GGUF file that
llama.cpp loads, in F32, F16, BF16, Q8_0, Q4_0 or llama.cpp's K-quant mixes (Q4_K_S, Q4_K_M,
Q5_K_S, Q5_K_M, Q6_K).

The file is what llama.cpp's own converter writes for the family: its tensor names (from
the one name table of ``gguf_file.py``, read the other way), q/k rows permuted into
interleaved-RoPE order for the Llama lineage, the tied head left out (llama.cpp reuses
token_embd), norms and other vectors in F32, the metadata keys its loader requires, and
the tokenizer as a SentencePiece ("llama") or byte-level BPE ("gpt2") vocabulary. Q8_0 and
Q4_0 blocks are made by the ``gguf`` package's reference quantizer; a matrix whose rows do
not split into blocks of 32 stays F16, as llama.cpp's quantizer falls back too. K-quant
blocks and each tensor's type in a K-quant mix come from ``gguf_kquants.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..atomic import atomic_file
from ..errors import UserError
from ..hub import resolve_model_path
from ..model.positions import rope_inverse_frequencies, rope_type
from ..weights.quantization import dequantize_weights
from .converter import read_source
from .gguf_file import GROUP_SIZE, PRE_TOKENIZERS, byte_level_pre_tokenizer, gguf_name
from .gguf_kquants import ENCODERS, KQUANT_FILE_TYPES, kquant_tensor_type, quantize_kquant

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", *KQUANT_FILE_TYPES)
# Hugging Face model_type -> (llama.cpp architecture, q/k rows permuted)
EXPORTABLE = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
              "qwen3": ("qwen3", False)}
# llama.cpp's general.file_type for each (LLAMA_FTYPE_ALL_F32 = 0, MOSTLY_F16 = 1, ...)
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32,
              **{name: file_type for name, (_, file_type) in KQUANT_FILE_TYPES.items()}}
# A probe text that tells llama.cpp's pre-tokenizers apart (contractions, digit runs,
# case changes, combining marks, newlines, code).
PROBE = ("Hello world! It's 2024: 1234567 apples, don't x//y.\n\n\tdef f(x):\n        return x**2  "
         "CamelCaseWord HTTPServer naïve cafe\u0301 ÉTÉ 3.14159 中文字符 한국어 \r\n  end")


def half_split_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k rows from rotate-half order to llama.cpp's adjacent-pair order (the inverse of
    ``llama2c.interleaved_to_half_split``): per head, rows (0..d/2-1, d/2..d-1) -> pairs."""
    out_features, in_features = w.shape
    # (n_heads, 2, head_dim/2, in) -> (n_heads, head_dim/2, 2, in)
    w = w.reshape(n_heads, 2, out_features // n_heads // 2, in_features).transpose(0, 2, 1, 3)
    return w.reshape(out_features, in_features)


def export_gguf(model_path: str | Path, gguf_path: str | Path, gguf_type: str = "f16", overwrite: bool = False,
                log=print) -> Path:
    """Write the model at ``model_path`` (an MLX or Hugging Face folder, quantized or not,
    or any source ``convert`` reads) to the GGUF file ``gguf_path``; returns the path."""
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, not {gguf_type!r}")
    target = Path(gguf_path).expanduser()
    if target.exists() and not overwrite:
        raise UserError(f"{target} already exists (pass --overwrite to replace it)")
    origin = resolve_model_path(model_path)
    source = read_source(origin)
    config = source.config
    model_type = config.get("model_type")
    if model_type not in EXPORTABLE:
        raise UserError(f"GGUF export supports {', '.join(EXPORTABLE)} models, not {model_type!r}")
    arch, permuted = EXPORTABLE[model_type]
    check_exportable(config, arch)
    weights = source.weights
    if source.quantization or config.get("quantization"):
        weights = dequantize_weights(weights, source.quantization or config["quantization"], mx.float32)
    with atomic_file(target) as tmp:
        write_file(tmp, arch, config, weights, source.files, gguf_type, permuted, log)
    log(f"wrote {target} ({arch}, {gguf_type.upper()}, {target.stat().st_size / 1e6:.1f} MB)")
    return target


def rope_scaling_of(config: dict) -> dict:
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def check_exportable(config: dict, arch: str) -> None:
    """One line for what a llama.cpp file of ``arch`` cannot express."""
    kind = rope_type(rope_scaling_of(config))
    supported = ("default", "linear", "llama3") if arch == "llama" else ("default", "linear")
    if kind not in supported:
        raise UserError(f"GGUF export does not write rope scaling {kind!r} yet (supported: {', '.join(supported)})")
    if config.get("sliding_window") and config.get("use_sliding_window", arch == "llama"):
        raise UserError("GGUF export does not write sliding-window attention (this model uses it)")


def write_file(path: Path, arch: str, config: dict, weights: dict, files: dict, gguf_type: str, permuted: bool,
               log) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.get("_name_or_path") or config.get("model_type"))
    add_hyperparameters(writer, config, gguf_type)
    add_tokenizer(writer, files, config)
    add_tensors(writer, arch, config, weights, gguf_type, permuted, log)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rope_theta(config: dict) -> float:
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def add_hyperparameters(writer, config: dict, gguf_type: str) -> None:
    """The keys llama.cpp's loader reads for a Llama-shaped model."""
    import gguf

    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(FILE_TYPES[gguf_type])
    scaling = rope_scaling_of(config)
    if rope_type(scaling) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


def llama3_factors(config: dict) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp holds it: each rotated pair's frequency divisor
    (head_dim / 2,), float32 (``rope_freqs.weight``, as its converter writes it)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    plain = rope_inverse_frequencies(head_dim, rope_theta(config), None, 0)
    scaled = rope_inverse_frequencies(head_dim, rope_theta(config), rope_scaling_of(config),
                                      config.get("max_position_embeddings", 2048))
    return (plain / scaled).astype(np.float32)


def tensor_type(name: str, w: np.ndarray, gguf_type: str, mix: dict):
    """The GGML type the tensor ``name`` (llama.cpp's name) is written in: vectors F32;
    matrices the asked type, F16 where their rows do not split into blocks of 32; in a
    K-quant file the type llama.cpp's mix gives it (``mix``: n_layers, tied, bigger_v)."""
    import gguf

    if w.ndim < 2 or gguf_type == "f32":
        return gguf.GGMLQuantizationType.F32
    if gguf_type in KQUANT_FILE_TYPES:
        return gguf.GGMLQuantizationType[kquant_tensor_type(name, w.shape, gguf_type, **mix)]
    if gguf_type in ("q8_0", "q4_0") and w.shape[-1] % GROUP_SIZE:
        return gguf.GGMLQuantizationType.F16
    return gguf.GGMLQuantizationType[gguf_type.upper()]


def kquant_mix(arch: str, config: dict, tied: bool) -> dict:
    """What llama.cpp's K-quant mix reads of the model: its layers, whether the head is the
    token embedding, and whether it is a 70B (80 layers, grouped KV heads), whose attn_v
    gets Q5_K instead of Q4_K."""
    n_layers = config["num_hidden_layers"]
    grouped = (config.get("num_key_value_heads") or config["num_attention_heads"]) != config["num_attention_heads"]
    return {"n_layers": n_layers, "tied": tied,
            "bigger_v": n_layers == 80 and (arch == "qwen2" or (arch == "llama" and grouped))}


def add_tensors(writer, arch: str, config: dict, weights: dict, gguf_type: str, permuted: bool, log) -> None:
    """Every tensor of ``weights`` (emptied on the way: each source array is freed once
    the writer has its converted copy) into ``writer``, in llama.cpp's names and types."""
    import gguf

    n_heads = config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    names = [n for n in weights if not (n == "lm_head.weight" and config.get("tie_word_embeddings"))]
    if rope_type(rope_scaling_of(config)) == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_factors(config))
    mix = kquant_mix(arch, config, tied="lm_head.weight" not in names)
    start, step = time.monotonic(), max(1, len(names) // 10)
    for i, name in enumerate(sorted(names)):
        w = np.array(weights.pop(name).astype(mx.float32))  # popped: the writer holds the copy (8B in F16: 16 GB, not 32)
        if permuted and name.endswith("self_attn.q_proj.weight"):
            w = half_split_to_interleaved(w, n_heads)
        if permuted and name.endswith("self_attn.k_proj.weight"):
            w = half_split_to_interleaved(w, n_kv_heads)
        try:
            llama_cpp_name = gguf_name(name, arch)
        except ValueError as e:
            raise UserError(f"GGUF export: {e}") from None
        kind = tensor_type(llama_cpp_name, w, gguf_type, mix)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(llama_cpp_name, w)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(llama_cpp_name, w.astype(np.float16))
        elif kind.name in ENCODERS:  # K-quants: ggml's reference quantizer, in numpy
            writer.add_tensor(llama_cpp_name, quantize_kquant(w, kind.name), raw_dtype=kind)
        else:  # BF16, Q8_0, Q5_0, Q5_1, Q4_0: bytes from gguf's reference quantizer
            writer.add_tensor(llama_cpp_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        elapsed = time.monotonic() - start
        if ((i + 1) % step == 0 or i + 1 == len(names)) and elapsed > 2:  # only for big models
            log(f"  {i + 1}/{len(names)} tensors, {elapsed:.0f} s, ETA {elapsed / (i + 1) * (len(names) - i - 1):.0f} s")


def add_tokenizer(writer, files: dict, config: dict) -> None:
    """The folder's tokenizer as llama.cpp's vocabulary metadata."""
    settings = json.loads(files.get("tokenizer_config.json", b"{}"))
    if "tokenizer.model" in files and "tokenizer.json" not in files:
        add_sentencepiece(writer, files["tokenizer.model"], settings)
    elif "tokenizer.json" in files:
        add_byte_level_bpe(writer, files["tokenizer.json"], settings)
    else:
        raise UserError("GGUF export needs the model's tokenizer (tokenizer.model or tokenizer.json beside it)")
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        value = config.get(key)
        if isinstance(value, list):  # several end tokens: llama.cpp keeps one, the first
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])


def add_sentencepiece(writer, model_bytes: bytes, settings: dict) -> None:
    """tokenizer.model's pieces, scores and types (GGUF numbers them as SentencePiece does)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(model_bytes)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([int(p.type) for p in proto.pieces])
    writer.add_unk_token_id(proto.trainer_spec.unk_id)
    if proto.trainer_spec.pad_id >= 0:
        writer.add_pad_token_id(proto.trainer_spec.pad_id)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.add_add_bos_token(bool(settings.get("add_bos_token", True)))
    writer.add_add_eos_token(bool(settings.get("add_eos_token", False)))


def add_byte_level_bpe(writer, tokenizer_json: bytes, settings: dict) -> None:
    """tokenizer.json's byte-level BPE: every id's piece (added tokens included), their
    types (3 special, 4 added, 1 normal), the merges, and llama.cpp's name of the split."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer_json)
    if spec.get("model", {}).get("type") != "BPE":
        raise UserError(f"GGUF export reads BPE tokenizers, not {spec.get('model', {}).get('type')!r}")
    tokenizer = Tokenizer.from_str(tokenizer_json.decode())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    pieces = [""] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        pieces[i] = piece
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    types = [(3 if added[i]["special"] else 4) if i in added else 1 for i in range(len(pieces))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    writer.add_token_list(pieces)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(bool(settings.get("add_bos_token", False)))


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) of the split that ``tokenizer`` makes,
    found by splitting a probe text both ways; one line when llama.cpp knows none like it."""
    if tokenizer.pre_tokenizer is None:
        raise UserError("GGUF export: this tokenizer has no pre-tokenizer llama.cpp can name")
    ours = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(PROBE)]
    for name in PRE_TOKENIZERS:
        theirs = byte_level_pre_tokenizer(name, Path("export"))
        if [piece for piece, _ in theirs.pre_tokenize_str(PROBE)] == ours:
            return name
    raise UserError("GGUF export: this tokenizer splits text unlike every pre-tokenizer llama.cpp knows")
