"""llama2.c checkpoints (karpathy/llama2.c ``export.py``): the legacy header format, and
the versioned 'ak42' format (version 1: float32, version 2: int8 Q8_0 groups), with the
SentencePiece tokenizer that sits beside them.

llama2.c rotates adjacent pairs (interleaved RoPE); Hugging Face rotates halves. q and k
rows are permuted into Hugging Face order here, so the output is a plain HF Llama that
mlx-lm loads too.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import UserError
from .sources import Source

HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
VERSIONED_HEADER_BYTES = 256
VERSIONED_MAGIC = (0x616B3432).to_bytes(4, "little")  # "ak42" as a little-endian uint32


@dataclass(frozen=True)
class Header:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool
    version: int  # 0: legacy
    group_size: int = 0  # version 2 only

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


LEGACY_HEADER_BYTES = 28
# Generous bounds on a legacy header's fields (it has no magic): far beyond any llama2.c
# model, far below the numbers any text's bytes make (printable ASCII read as a
# little-endian int32 is at least 0x0a000000), so other files are told apart from it.
HEADER_LIMITS = {"dim": 1 << 16, "hidden_dim": 1 << 18, "n_layers": 1 << 10, "n_heads": 1 << 10,
                 "n_kv_heads": 1 << 10, "vocab_size": 1 << 21, "seq_len": 1 << 21}


def may_be_llama2c(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first 28 bytes or more) can be a llama2.c
    checkpoint: the versioned format's magic, or a legacy header whose every field is in
    range (a negative vocab_size means a separate classifier)."""
    if head[:4] == VERSIONED_MAGIC:
        return True
    if len(head) < LEGACY_HEADER_BYTES:
        return False
    values = struct.unpack_from("<7i", head, 0)
    return all(0 < abs(value) <= HEADER_LIMITS[name] for name, value in zip(HEADER_FIELDS, values))


def read_header(data: bytes, path: Path) -> Header:
    if len(data) < LEGACY_HEADER_BYTES:
        raise UserError(f"{path} is too small to be a llama2.c checkpoint ({len(data)} bytes)")
    if data[:4] == VERSIONED_MAGIC:
        if len(data) < VERSIONED_HEADER_BYTES:
            raise UserError(f"{path} is truncated: its 256-byte llama2.c header is incomplete")
        version = struct.unpack_from("<i", data, 4)[0]
        if version not in (1, 2):
            raise UserError(f"{path}: llama2.c format version {version} is not supported (1, 2)")
        values = struct.unpack_from("<7i", data, 8)
        shared = bool(data[36])
        group_size = struct.unpack_from("<i", data, 37)[0] if version == 2 else 0
        header = Header(*values, shared_classifier=shared, version=version, group_size=group_size)
    else:
        values = list(struct.unpack_from("<7i", data, 0))
        shared = values[5] > 0  # a negative vocab_size means a separate classifier
        values[5] = abs(values[5])
        header = Header(*values, shared_classifier=shared, version=0)
    sane = all(getattr(header, f) > 0 for f in HEADER_FIELDS) and header.dim % header.n_heads == 0
    if not sane or header.n_heads % header.n_kv_heads or (header.version == 2 and header.group_size <= 0):
        raise UserError(f"{path} does not start with a valid llama2.c header ({header})")
    return header


def tensor_plan(h: Header) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) in the order the file stores them."""
    L = range(h.n_layers)
    per_layer = lambda name, shape: [(f"model.layers.{i}.{name}", shape) for i in L]  # noqa: E731
    norms_att = per_layer("input_layernorm.weight", (h.dim,))
    norms_ffn = per_layer("post_attention_layernorm.weight", (h.dim,))
    matrices = [
        *per_layer("self_attn.q_proj.weight", (h.dim, h.dim)),
        *per_layer("self_attn.k_proj.weight", (h.kv_dim, h.dim)),
        *per_layer("self_attn.v_proj.weight", (h.kv_dim, h.dim)),
        *per_layer("self_attn.o_proj.weight", (h.dim, h.dim)),
    ]
    ffn = [
        *per_layer("mlp.gate_proj.weight", (h.hidden_dim, h.dim)),
        *per_layer("mlp.down_proj.weight", (h.dim, h.hidden_dim)),
        *per_layer("mlp.up_proj.weight", (h.hidden_dim, h.dim)),
    ]
    embed = [("model.embed_tokens.weight", (h.vocab_size, h.dim))]
    head = [] if h.shared_classifier else [("lm_head.weight", (h.vocab_size, h.dim))]
    final = [("model.norm.weight", (h.dim,))]
    if h.version == 0:
        freqs = [("freq_cis_real", (h.seq_len, h.head_dim // 2)), ("freq_cis_imag", (h.seq_len, h.head_dim // 2))]
        return embed + norms_att + matrices + norms_ffn + ffn + final + freqs + head
    return norms_att + norms_ffn + final + embed + matrices + ffn + head


def expected_size(h: Header, plan) -> int:
    if h.version == 2:  # norms in float32, every matrix as int8 values + one float32 scale per group
        return VERSIONED_HEADER_BYTES + sum(
            4 * n if len(shape) == 1 else n + 4 * (n // h.group_size) for n, shape in ((int(np.prod(s)), s) for _, s in plan)
        )
    start = VERSIONED_HEADER_BYTES if h.version == 1 else LEGACY_HEADER_BYTES
    return start + 4 * sum(int(np.prod(shape)) for _, shape in plan)


def read_tensors(data: memoryview, h: Header, plan) -> dict[str, np.ndarray]:
    offset = LEGACY_HEADER_BYTES if h.version == 0 else VERSIONED_HEADER_BYTES
    tensors = {}
    for name, shape in plan:
        n = int(np.prod(shape))
        if h.version == 2 and len(shape) == 2:
            q = np.frombuffer(data, np.int8, n, offset).astype(np.float32)
            scales = np.frombuffer(data, "<f4", n // h.group_size, offset + n)
            # Q8_0 groups run over the flattened matrix, so they may span rows.
            tensors[name] = (q.reshape(-1, h.group_size) * scales[:, None]).reshape(shape)
            offset += n + 4 * (n // h.group_size)
        else:
            tensors[name] = np.frombuffer(data, "<f4", n, offset).reshape(shape)
            offset += 4 * n
    return tensors


def interleaved_to_half_split(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of q/k from adjacent-pair RoPE order to rotate-half order (as HF's
    convert_llama_weights_to_hf): per head, rows (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...)."""
    out_features, in_features = w.shape
    # (n_heads, head_dim/2, 2, in) -> (n_heads, 2, head_dim/2, in)
    w = w.reshape(n_heads, out_features // n_heads // 2, 2, in_features).transpose(0, 2, 1, 3)
    return w.reshape(out_features, in_features)


def hf_config(h: Header, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h.dim,
        "intermediate_size": h.hidden_dim,
        "num_hidden_layers": h.n_layers,
        "num_attention_heads": h.n_heads,
        "num_key_value_heads": h.n_kv_heads,
        "head_dim": h.head_dim,
        "vocab_size": h.vocab_size,
        "max_position_embeddings": h.seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": h.shared_classifier,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def find_tokenizer(path: Path, vocab_size: int) -> Path:
    """llama2.c keeps the SentencePiece model beside the checkpoint: ``tokenizer.model``,
    or ``tok{vocab_size}.model`` as its ``train_vocab`` names custom ones."""
    for name in ("tokenizer.model", f"tok{vocab_size}.model"):
        if (path.parent / name).is_file():
            return path.parent / name
    raise UserError(
        f"no SentencePiece tokenizer beside {path}: expected tokenizer.model or tok{vocab_size}.model in {path.parent}"
    )


def tokenizer_files(tokenizer_path: Path, h: Header) -> tuple[dict[str, bytes], int, int]:
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    except Exception as e:
        raise UserError(f"{tokenizer_path} is not a SentencePiece model ({e})") from None
    if sp.vocab_size() != h.vocab_size:
        raise UserError(f"{tokenizer_path} has {sp.vocab_size()} tokens but the checkpoint has {h.vocab_size}")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": sp.id_to_piece(sp.bos_id()),
        "eos_token": sp.id_to_piece(sp.eos_id()),
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": h.seq_len,
    }
    files = {"tokenizer.model": tokenizer_path.read_bytes(), "tokenizer_config.json": json.dumps(config, indent=2).encode()}
    return files, sp.bos_id(), sp.eos_id()


def read_llama2c(path: Path) -> Source:
    data = path.read_bytes()
    h = read_header(data, path)
    plan = tensor_plan(h)
    if h.version == 2 and any(int(np.prod(s)) % h.group_size for _, s in plan if len(s) == 2):
        raise UserError(f"{path}: group size {h.group_size} does not divide every matrix")
    size = expected_size(h, plan)
    if len(data) != size:
        raise UserError(
            f"{path} is {len(data)} bytes but its llama2.c header (version {h.version}, dim {h.dim}, "
            f"{h.n_layers} layers, vocab {h.vocab_size}) implies {size}: truncated or not a llama2.c checkpoint"
        )
    files, bos_id, eos_id = tokenizer_files(find_tokenizer(path, h.vocab_size), h)
    tensors = read_tensors(memoryview(data), h, plan)
    tensors.pop("freq_cis_real", None)  # legacy RoPE tables; RoPE is recomputed
    tensors.pop("freq_cis_imag", None)
    for i in range(h.n_layers):
        q, k = f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"
        tensors[q] = interleaved_to_half_split(tensors[q], h.n_heads)
        tensors[k] = interleaved_to_half_split(tensors[k], h.n_kv_heads)
    weights = {name: mx.array(np.ascontiguousarray(t, dtype=np.float32)) for name, t in tensors.items()}
    return Source(config=hf_config(h, bos_id, eos_id), weights=weights, files=files)
