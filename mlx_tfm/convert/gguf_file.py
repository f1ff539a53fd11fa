"""GGUF files (llama.cpp), read with the ``gguf`` package.

Q8_0, Q4_0 and Q4_1 blocks (32 weights, one float16 scale, Q4_1 also an offset) are
exactly MLX affine quantization with group size 32, so the most common of them is carried
over bit for bit; every other tensor is decoded to float. The tokenizer metadata becomes a
``tokenizer.model`` for a SentencePiece-style ("llama") vocabulary, a ``tokenizer.json``
for a GPT-2-style byte-level BPE ("gpt2") one.

Architectures: llama and qwen2, which share llama.cpp's tensor names. llama.cpp's converter
permutes q/k rows of Llama models into interleaved-RoPE order; that is undone here so the
output is a plain Hugging Face Llama.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_tfm.errors import UserError

from .sources import Source
from .llama2c import interleaved_to_half_split

# GGUF tensor names -> Hugging Face Llama / Qwen2 names.
LLAMA_NAMES = (
    (r"token_embd\.weight", r"model.embed_tokens.weight"),
    (r"output_norm\.weight", r"model.norm.weight"),
    (r"output\.weight", r"lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_q\.bias", r"model.layers.\1.self_attn.q_proj.bias"),
    (r"blk\.(\d+)\.attn_k\.bias", r"model.layers.\1.self_attn.k_proj.bias"),
    (r"blk\.(\d+)\.attn_v\.bias", r"model.layers.\1.self_attn.v_proj.bias"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
)


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str  # the Hugging Face model_type it becomes
    hf_architecture: str
    permuted_qk: bool  # llama.cpp stores Llama q/k rows in interleaved-RoPE order


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
# Types MLX holds exactly: name -> bits (group size 32).
EXACT_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
# Types decoded to float with gguf's reference decoder.
DECODED_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GROUP_SIZE = 32


def open_reader(path: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/... on corrupt files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} is not a readable GGUF file: truncated or corrupt ({reason})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise UserError(f"{path} is truncated: tensor {t.name} ends past the end of the file")
    return reader


def metadata(reader) -> dict:
    """Every key/value field as a plain Python value (strings, numbers, lists)."""
    values = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        values[name] = field.contents()
    return values


def hf_config(meta: dict, tensors: dict, arch: str) -> dict:
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    try:
        n_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        config = {
            "architectures": [GGUF_ARCHITECTURES[arch].hf_architecture],
            "model_type": GGUF_ARCHITECTURES[arch].model_type,
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
            "head_dim": int(get("attention.key_length", hidden // n_heads)),
            "vocab_size": int(tensors["token_embd.weight"].shape[1]),
            "max_position_embeddings": int(get("context_length", 2048)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in tensors,
        }
    except (TypeError, KeyError) as e:
        raise UserError(f"GGUF metadata lacks what a {arch} model needs ({e})") from None
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{key}"])
    return config


def hf_name(name: str) -> str:
    for pattern, replacement in LLAMA_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return name  # left as is: the strict check names it as unexpected


def exact_type(tensors: dict) -> str | None:
    """The exactly-representable quantization type most 2D weights use (one per folder:
    config.json holds one bits/group_size)."""
    counts = Counter(t.tensor_type.name for t in tensors.values() if t.tensor_type.name in EXACT_TYPES)
    return counts.most_common(1)[0][0] if counts else None


def unpermute_rows(data: np.ndarray, name: str, config: dict, arch: str) -> np.ndarray:
    """Undo llama.cpp's q/k permutation; works on raw quantized rows as on float rows."""
    if not GGUF_ARCHITECTURES[arch].permuted_qk:
        return data
    if name.endswith("self_attn.q_proj.weight"):
        return interleaved_to_half_split(data, config["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return interleaved_to_half_split(data, config["num_key_value_heads"])
    return data


def decode_float(t, data: np.ndarray) -> mx.array:
    import gguf

    kind = t.tensor_type.name
    if kind == "BF16":
        return mx.array(gguf.quants.dequantize(data, t.tensor_type)).astype(mx.bfloat16)
    if kind in FLOAT_TYPES:
        return mx.array(np.ascontiguousarray(data))
    return mx.array(gguf.quants.dequantize(data, t.tensor_type).astype(np.float32))


def to_mlx_quantized(kind: str, data: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    """GGUF blocks (rows, n_blocks * block_bytes) -> MLX (packed uint32, scales, biases).

    Q8_0: w = d * q, q int8    -> q + 128 unsigned, scale d, bias -128 d
    Q4_0: w = d * (q - 8)      -> scale d, bias -8 d
    Q4_1: w = d * q + m        -> scale d, bias m
    MLX packs values little-endian, element i of a uint32 at bits [i*bits, (i+1)*bits).
    """
    rows = data.shape[0]
    head = 4 if kind == "Q4_1" else 2
    blocks = data.reshape(rows, -1, head + (GROUP_SIZE if kind == "Q8_0" else GROUP_SIZE // 2))
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]  # (rows, n_blocks)
    payload = np.ascontiguousarray(blocks[..., head:])
    if kind == "Q8_0":
        values = (payload.view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # (rows, n_blocks, 32)
        packed = values.reshape(rows, -1)
        biases = -128 * d.astype(np.float32)
    else:
        # a block's byte j holds element j (low nibble) and element j + 16 (high nibble)
        values = np.concatenate([payload & 0x0F, payload >> 4], axis=-1)  # (rows, n_blocks, 32)
        pairs = values.reshape(rows, -1, 2)
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
        biases = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if kind == "Q4_1" else -8 * d.astype(np.float32)
    weight = np.ascontiguousarray(packed).view(np.uint32)  # (rows, in * bits / 32)
    scales, biases = d.astype(np.float32), biases.astype(np.float32)
    if np.abs(biases).max() <= np.finfo(np.float16).max:  # -128 d can overflow float16
        scales, biases = d, biases.astype(np.float16)
    return mx.array(weight), mx.array(scales), mx.array(biases)


def check_tensor_types(reader, path: Path) -> None:
    supported = set(FLOAT_TYPES) | set(EXACT_TYPES) | set(DECODED_TYPES)
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise UserError(
                f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(sorted(supported))})"
            )


def read_tensors(reader, config: dict, arch: str) -> tuple[dict, dict | None]:
    tensors = {t.name: t for t in reader.tensors}
    exact = exact_type(tensors)
    weights = {}
    for gguf_name, t in tensors.items():
        name = hf_name(gguf_name)
        data = unpermute_rows(t.data, name, config, arch)
        kind = t.tensor_type.name
        if kind == exact and data.ndim == 2:
            base = name.removesuffix(".weight")
            weights[name], weights[f"{base}.scales"], weights[f"{base}.biases"] = to_mlx_quantized(kind, data)
        else:
            weights[name] = decode_float(t, data)
    quantization = {"group_size": GROUP_SIZE, "bits": EXACT_TYPES[exact]} if exact else None
    return weights, quantization


def sentencepiece_tokenizer(meta: dict) -> dict[str, bytes]:
    """A llama-style GGUF vocabulary (pieces, scores, types) -> tokenizer.model. GGUF token
    types use SentencePiece's own numbering (1 normal ... 6 byte)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    proto = pb.ModelProto()
    for piece, score, kind in zip(tokens, scores, types):
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, float(score), int(kind)
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = 6 in types
    spec.unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    spec.bos_id = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    spec.eos_id = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    spec.pad_id = int(meta.get("tokenizer.ggml.padding_token_id", -1))
    spec.unk_piece, spec.bos_piece, spec.eos_piece = tokens[spec.unk_id], tokens[spec.bos_id], tokens[spec.eos_id]
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": spec.bos_piece,
        "eos_token": spec.eos_piece,
        "unk_token": spec.unk_piece,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "legacy": True,
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return {
        "tokenizer.model": proto.SerializeToString(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2).encode(),
    }


# llama.cpp's ``tokenizer.ggml.pre`` names -> the regex that splits text before byte-level
# BPE (None: GPT-2's own, built into the ByteLevel pre-tokenizer).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "default": None,
    "gpt2": None,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}


def byte_level_pre_tokenizer(pre: str, path: Path):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZER_SPLITS:
        raise UserError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZER_SPLITS)})")
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def byte_level_bpe_tokenizer(meta: dict, path: Path) -> dict[str, bytes]:
    """A GPT-2-style GGUF vocabulary (byte-level pieces and merges) -> tokenizer.json,
    built with the ``tokenizers`` library."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    pre_tokenizer = byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    # control tokens (type 3) are special; user-defined ones (type 4) are matched whole
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i, k in enumerate(types) if k == 3])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, k in enumerate(types) if k == 4])
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    if add_bos:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, int(bos_id))])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[int(bos_id)] if bos_id is not None else None,
        "eos_token": tokens[int(eos_id)] if eos_id is not None else None,
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": tokenizer.to_str().encode(), "tokenizer_config.json": json.dumps(tokenizer_config, indent=2).encode()}


def tokenizer_files(meta: dict, path: Path) -> dict[str, bytes]:
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":
        return sentencepiece_tokenizer(meta)
    if model == "gpt2":
        return byte_level_bpe_tokenizer(meta, path)
    raise UserError(f"{path}: GGUF tokenizer model {model!r} is not supported (supported: llama, gpt2)")


def read_gguf(path: Path) -> Source:
    reader = open_reader(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")
    if "token_embd.weight" not in {t.name for t in reader.tensors}:
        raise UserError(f"{path}: GGUF file has no token_embd.weight tensor")
    check_tensor_types(reader, path)
    files = tokenizer_files(meta, path)
    config = hf_config(meta, {t.name: t for t in reader.tensors}, arch)
    weights, quantization = read_tensors(reader, config, arch)
    kinds = {t.tensor_type.name for t in reader.tensors}
    # float16 whenever blocks are carried over: their float16 scales stay exact
    config["torch_dtype"] = "float32" if kinds == {"F32"} else "bfloat16" if kinds <= {"F32", "BF16"} else "float16"
    return Source(config=config, weights=weights, files=files, quantization=quantization)
