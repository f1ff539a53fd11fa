"""llama.cpp's GGUF files of the encoders, bert and t5, read back into the checkpoints of
their families (``mlx_tfm.families.encoders``), and the vocabularies those files carry:
tokenizer model ``bert`` (WordPiece written in phantom spaces) and ``t5`` (SentencePiece
unigram with its normalizer's precompiled character map).

Each row of ``ENCODER_ARCHITECTURES`` holds the fields of one ``GGUFArchitecture``
(``gguf_file.py`` builds them):

- bert: llama.cpp's converter drops the pooler and the masked-LM head, so a file is the
  bare encoder (``BertModel``: hidden states); a classifier's file, whose head reads the
  dropped pooler, is named as unsupported.
- t5: one shared embedding table; a gated feed-forward (v1.1, flan-t5, mT5) the tensors
  tell, its up projection being the checkpoint's ``wi_1``; relative positions bucketed up
  to 128, llama.cpp's fixed distance.
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import UserError
from .gguf_more_families import layer_names, standalone

NamePair = tuple[str, str]


# BERT: the encoder's tensors in BertModel's names (llama.cpp drops the pooler and the
# masked-LM head, so a file is the bare encoder); a WordPiece vocabulary in phantom spaces

BERT_NAMES = (
    ("token_embd.weight", "embeddings.word_embeddings.weight"),
    ("token_types.weight", "embeddings.token_type_embeddings.weight"),
    ("position_embd.weight", "embeddings.position_embeddings.weight"),
    ("token_embd_norm.{kind}", "embeddings.LayerNorm.{kind}"),
) + layer_names("encoder.layer", [
    ("attn_q", "attention.self.query"), ("attn_k", "attention.self.key"), ("attn_v", "attention.self.value"),
    ("attn_output", "attention.output.dense"), ("attn_output_norm", "attention.output.LayerNorm"),
    ("ffn_up", "intermediate.dense"), ("ffn_down", "output.dense"), ("layer_output_norm", "output.LayerNorm"),
])


def bert_keys(get, base: dict, tensors: dict) -> dict:
    """BertModel writes TextModel's keys and non-causal attention; the token types' count
    is the token_types table's rows. A classifier's file lacks the pooler it reads."""
    if "cls.output.weight" in tensors or "cls.weight" in tensors:
        raise UserError("GGUF bert classifier heads are not supported (llama.cpp's converter drops the pooler; "
                        "the encoder's hidden states are)")
    return {
        "hidden_size": int(get("embedding_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(get("attention.head_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "max_position_embeddings": int(get("context_length")),
        "type_vocab_size": int(tensors["token_types.weight"].shape[1]) if "token_types.weight" in tensors else 1,
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-12)),
        "hidden_act": "gelu",
    }


def wordpiece_piece(token: str, kind: int) -> str:
    """llama.cpp's phantom-space piece back to WordPiece's: a word start "\u2581x" -> "x",
    a continuation "x" -> "##x"; control tokens (type 3) as they are."""
    if kind == 3:
        return token
    return token[1:] if token.startswith("\u2581") else "##" + token


def bert_tokenizer(meta: dict) -> dict[str, bytes]:
    """A BERT GGUF vocabulary (tokenizer model ``bert``) -> tokenizer.json: WordPiece over
    lowercased, accent-stripped words split at whitespace and punctuation, as llama.cpp's
    WPM tokenizer splits; [CLS] (the file's BOS) $A [SEP] around each text."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pieces = [wordpiece_piece(t, k) for t, k in zip(tokens, types)]
    special = {key: pieces[int(meta[f"tokenizer.ggml.{key}_token_id"])] for key in ("bos", "seperator", "unknown",
                                                                                    "padding", "mask")
               if f"tokenizer.ggml.{key}_token_id" in meta}
    unk = special.get("unknown", "[UNK]")
    tokenizer = Tokenizer(models.WordPiece(vocab={p: i for i, p in enumerate(pieces)}, unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    control = [AddedToken(p, special=True, normalized=False) for p, k in zip(pieces, types) if k == 3]
    tokenizer.add_special_tokens(control)
    cls, sep = special.get("bos", "[CLS]"), special.get("seperator", "[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, pieces.index(cls)), (sep, pieces.index(sep))])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "cls_token": cls, "sep_token": sep, "unk_token": unk,
              "pad_token": special.get("padding"), "mask_token": special.get("mask"),
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tokenizer.to_str().encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}


# T5 (v1.0, v1.1, flan-t5, mT5): encoder and decoder blocks under enc. / dec., the relative
# position buckets in each stack's first block; an ungated ReLU or a gated GELU feed-forward

def t5_stack(prefix: str, stack: str, parts: list[tuple[str, str]]) -> tuple[NamePair, ...]:
    """``{prefix}.blk.N.{gguf}`` <-> ``{stack}.block.N.layer.{hf}`` (weight or bias) for each pair."""
    return tuple((f"{prefix}.blk.{{layer}}.{g}.{{kind}}", f"{stack}.block.{{layer}}.layer.{h}.{{kind}}")
                 for g, h in parts)


T5_FEED_FORWARD = [("ffn_gate", "DenseReluDense.wi_0"), ("ffn_up", "DenseReluDense.wi"),
                   ("ffn_down", "DenseReluDense.wo")]
T5_NAMES = (
    ("token_embd.weight", "shared.weight"),
    ("output.weight", "lm_head.weight"),
    ("enc.output_norm.weight", "encoder.final_layer_norm.weight"),
    ("dec.output_norm.weight", "decoder.final_layer_norm.weight"),
) + t5_stack("enc", "encoder", [
    ("attn_norm", "0.layer_norm"), ("attn_q", "0.SelfAttention.q"), ("attn_k", "0.SelfAttention.k"),
    ("attn_v", "0.SelfAttention.v"), ("attn_o", "0.SelfAttention.o"),
    ("attn_rel_b", "0.SelfAttention.relative_attention_bias"),
    ("ffn_norm", "1.layer_norm"), *((g, "1." + h) for g, h in T5_FEED_FORWARD),
]) + t5_stack("dec", "decoder", [
    ("attn_norm", "0.layer_norm"), ("attn_q", "0.SelfAttention.q"), ("attn_k", "0.SelfAttention.k"),
    ("attn_v", "0.SelfAttention.v"), ("attn_o", "0.SelfAttention.o"),
    ("attn_rel_b", "0.SelfAttention.relative_attention_bias"),
    ("cross_attn_norm", "1.layer_norm"), ("cross_attn_q", "1.EncDecAttention.q"),
    ("cross_attn_k", "1.EncDecAttention.k"),
    ("cross_attn_v", "1.EncDecAttention.v"), ("cross_attn_o", "1.EncDecAttention.o"),
    ("ffn_norm", "2.layer_norm"), *((g, "2." + h) for g, h in T5_FEED_FORWARD),
])
# llama.cpp's t5 buckets relative positions up to this distance, which no key carries
T5_MAX_DISTANCE = 128


def t5_keys(get, base: dict, tensors: dict) -> dict:
    """T5Model writes the widths, both stacks' depths, the bucket count; a gated feed-forward
    (v1.1, flan-t5, mT5: GELU) the tensors tell, as llama.cpp's runtime does."""
    n_layers = int(get("block_count"))
    return {
        "d_model": int(get("embedding_length")),
        "d_ff": int(get("feed_forward_length")),
        "num_layers": n_layers,
        "num_decoder_layers": int(get("decoder_block_count") or n_layers),
        "num_heads": int(get("attention.head_count")),
        "d_kv": int(get("attention.key_length")),
        "layer_norm_epsilon": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "relative_attention_num_buckets": int(get("attention.relative_buckets_count") or 32),
        "relative_attention_max_distance": T5_MAX_DISTANCE,
        "feed_forward_proj": "gated-gelu" if "enc.blk.0.ffn_gate.weight" in tensors else "relu",
        "decoder_start_token_id": int(get("decoder_start_token_id") or 0),
    }


def sentencepiece_pieces(meta: dict, model_type: str):
    """A SentencePiece ModelProto holding a GGUF vocabulary's pieces, scores and types (GGUF
    numbers token types as SentencePiece does: 1 normal ... 6 byte), its trainer spec of
    ``model_type`` ("BPE" for llama's vocabularies, "UNIGRAM" for T5's) and size set."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    proto = pb.ModelProto()
    for piece, score, kind in zip(tokens, scores, types):
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, float(score), int(kind)
    proto.trainer_spec.model_type = getattr(pb.TrainerSpec, model_type)
    proto.trainer_spec.vocab_size = len(tokens)
    return proto


def unigram_tokenizer(meta: dict) -> dict[str, bytes]:
    """A T5-style GGUF vocabulary (tokenizer model ``t5``: SentencePiece unigram pieces,
    scores, types and the normalizer's precompiled character map) -> tokenizer.model, with
    T5's special tokens (pad, </s>, unk) in tokenizer_config.json."""
    tokens = meta["tokenizer.ggml.tokens"]
    proto = sentencepiece_pieces(meta, "UNIGRAM")
    spec = proto.trainer_spec
    ids = {key: int(meta[f"tokenizer.ggml.{key}_token_id"]) for key in ("unknown", "eos", "padding", "bos")
           if f"tokenizer.ggml.{key}_token_id" in meta}
    spec.unk_id, spec.eos_id = ids.get("unknown", 2), ids.get("eos", 1)
    spec.pad_id, spec.bos_id = ids.get("padding", -1), ids.get("bos", -1)
    normalizer = proto.normalizer_spec
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    normalizer.name = "nmt_nfkc" if charsmap else "identity"
    normalizer.precompiled_charsmap = bytes(charsmap or b"")
    normalizer.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", True))
    normalizer.escape_whitespaces = True
    config = {"tokenizer_class": "T5Tokenizer", "eos_token": tokens[spec.eos_id], "unk_token": tokens[spec.unk_id],
              "pad_token": tokens[spec.pad_id] if spec.pad_id >= 0 else None, "extra_ids": 0}
    return {"tokenizer.model": proto.SerializeToString(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def restore_t5(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """A gated feed-forward's up projection is the checkpoint's wi_1 (an ungated one's wi)."""
    if config["feed_forward_proj"].startswith("gated") and name.endswith("DenseReluDense.wi.weight"):
        return {name.replace(".wi.", ".wi_1."): data}
    return {name: data}


ENCODER_ARCHITECTURES = {
    "bert": standalone("bert", "BertModel", BERT_NAMES, bert_keys),
    "t5": standalone("t5", "T5ForConditionalGeneration", T5_NAMES, t5_keys, restore=restore_t5),
}
