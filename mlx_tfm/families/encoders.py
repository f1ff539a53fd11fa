"""Encoder-only families (BERT, RoBERTa, DistilBERT, ModernBERT) and T5: config ->
``ModelArgs`` fields, their renames, and the heads they keep or drop."""

from __future__ import annotations

from ..errors import UserError
from ..model.config import ModelArgs
from .common import Architecture, activation, rope_settings, split_rows
from .decoders import split_qkv

# -- encoders (the BERT family) and encoder-decoders (T5) ---------------------------------
# On disk these keep Hugging Face's names (a converted folder loads in transformers as it
# is); the renames map them onto the one model's names and the heads' (mlx_tfm/model/heads.py):
# ``lm_head.{dense,norm,bias}`` for masked LM, ``classifier.{dense,norm,out_proj}`` for
# sequence classification. A checkpoint's other head is dropped (BERT's pooler and NSP
# layer when the MLM head is built, the MLM head when a classifier is).


def encoder_head(config: dict) -> dict:
    """The head transformers' ``architectures`` names: ``*ForMaskedLM`` / ``*ForPreTraining``
    -> masked LM, ``*ForSequenceClassification`` -> classification (with its labels), else
    none (hidden states, as ``*Model`` and sentence-transformers folders)."""
    name = (config.get("architectures") or [""])[0]
    if name.endswith("ForSequenceClassification"):
        labels = len(config.get("id2label") or {}) or config.get("num_labels") or 2
        return {"head": "classification", "num_labels": labels}
    if name.endswith(("ForMaskedLM", "ForPreTraining")):
        return {"head": "masked_lm"}
    return {"head": "none"}


def bert_args(config: dict) -> dict:
    """BERT: learned positions and token types, a LayerNorm over the embeddings, post-norm
    LayerNorm blocks with biases everywhere, exact GELU."""
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"{config['model_type']} with position_embedding_type "
                        f"{config['position_embedding_type']!r} is not supported (only absolute)")
    act = activation(config.get("hidden_act", "gelu"))
    return {
        "model_type": config["model_type"], "kind": "encoder",
        "vocab_size": config.get("vocab_size", 30522), "hidden_size": config.get("hidden_size", 768),
        "num_hidden_layers": config.get("num_hidden_layers", 12),
        "num_attention_heads": config.get("num_attention_heads", 12),
        "intermediate_size": config.get("intermediate_size", 3072),
        "max_position_embeddings": config.get("max_position_embeddings", 512),
        "type_vocab_size": config.get("type_vocab_size", 2),
        "norm_type": "layernorm", "norm_eps": config.get("layer_norm_eps", 1e-12), "norm_placement": "post",
        "final_norm": False, "embedding_norm": True, "position_embedding": "learned",
        "hidden_act": act, "ffn_gated": False, "mlp_bias": True, "attention_bias": True, "attention_out_bias": True,
        "tie_word_embeddings": True, "head_activation": act, "classifier_activation": "tanh",
        **encoder_head(config),
    }


def roberta_args(config: dict) -> dict:
    """RoBERTa and XLM-R: BERT whose positions start after the padding index; the MLM
    head's activation is always GELU."""
    padding_idx = config.get("pad_token_id", 1)
    return {**bert_args({"type_vocab_size": 1, **config}), "position_offset": padding_idx + 1,
            "head_activation": "gelu"}


def distilbert_args(config: dict) -> dict:
    """DistilBERT: BERT without token types, in its own config keys; ReLU before its classifier."""
    keys = {"hidden_size": config.get("dim", 768), "num_hidden_layers": config.get("n_layers", 6),
            "num_attention_heads": config.get("n_heads", 12), "intermediate_size": config.get("hidden_dim", 3072),
            "hidden_act": config.get("activation", "gelu"), "type_vocab_size": 0, "layer_norm_eps": 1e-12}
    return {**bert_args({**config, **keys}), "classifier_activation": "relu"}


def modernbert_args(config: dict) -> dict:
    """ModernBERT: pre-norm LayerNorm without bias (none before layer 0's attention: the
    embeddings are normed), GeGLU, RoPE with a global and a local base, every
    ``global_attn_every_n_layers``-th layer global, the others a sliding window of
    ``local_attention`` (half on each side)."""
    n_layers = config.get("num_hidden_layers", 22)
    every = config.get("global_attn_every_n_layers", 3)
    layer_types = config.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                                 for i in range(n_layers)]
    rope = rope_settings(config)
    if "rope_parameters" not in config or "full_attention" not in (config.get("rope_parameters") or {}):
        rope = {**rope, "rope_theta": config.get("global_rope_theta", 160000.0),
                "rope_local_theta": config.get("local_rope_theta", 10000.0)}
    act = activation(config.get("hidden_activation", "gelu"))
    return {
        "model_type": "modernbert", "kind": "encoder",
        "vocab_size": config.get("vocab_size", 50368), "hidden_size": config.get("hidden_size", 768),
        "num_hidden_layers": n_layers, "num_attention_heads": config.get("num_attention_heads", 12),
        "intermediate_size": config.get("intermediate_size", 1152),
        "max_position_embeddings": config.get("max_position_embeddings", 8192), **rope,
        "norm_type": "layernorm", "norm_eps": config.get("norm_eps", 1e-5), "norm_bias": config.get("norm_bias", False),
        "embedding_norm": True, "first_layer_norm": False,
        "hidden_act": act, "ffn_gated": True, "mlp_bias": config.get("mlp_bias", False),
        "attention_bias": config.get("attention_bias", False), "attention_out_bias": config.get("attention_bias", False),
        "sliding_window": config.get("local_attention", 128) // 2, "layer_types": layer_types,
        "tie_word_embeddings": True, "head_activation": activation(config.get("classifier_activation", "gelu")),
        "head_bias": config.get("classifier_bias", False), "decoder_bias": config.get("decoder_bias", True),
        "classifier_pooling": config.get("classifier_pooling", "cls"),
        "classifier_activation": activation(config.get("classifier_activation", "gelu")), "classifier_norm": True,
        **encoder_head(config),
    }


def t5_args(config: dict) -> dict:
    """T5 (v1.0: ReLU, tied head read at d_model^-0.5) and v1.1 / flan-t5 / mT5 (gated
    tanh-GELU, their own LM head, no rescale): RMSNorm pre-norm blocks without biases,
    unscaled attention scores, relative position buckets instead of positions."""
    ff = config.get("feed_forward_proj", "relu")
    gated = ff.startswith("gated-")
    act = "gelu_tanh" if ff == "gated-gelu" else activation(ff.split("-")[-1])
    rescaled = config["model_type"] == "t5" and config.get(
        "scale_decoder_outputs", config.get("tie_word_embeddings", True) is not False)
    D = config.get("d_model", 512)
    n_layers = config.get("num_layers", 6)
    return {
        "model_type": config["model_type"], "kind": "encoder-decoder",
        "vocab_size": config.get("vocab_size", 32128), "hidden_size": D, "num_hidden_layers": n_layers,
        "num_decoder_layers": config.get("num_decoder_layers") or n_layers,
        "num_attention_heads": config.get("num_heads", 8), "head_dim": config.get("d_kv", 64),
        "intermediate_size": config.get("d_ff", 2048),
        "norm_type": "rmsnorm", "norm_eps": config.get("layer_norm_epsilon", 1e-6),
        "hidden_act": act, "ffn_gated": gated, "attention_scale": 1.0, "position_embedding": "none",
        "relative_attention_num_buckets": config.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": config.get("relative_attention_max_distance", 128),
        "tie_word_embeddings": rescaled, "logit_scale": D**-0.5 if rescaled else 1.0,
        "decoder_start_token_id": config.get("decoder_start_token_id") or config.get("pad_token_id") or 0,
    }


def encoder_renames(prefix: str, layer: str, parts: dict[str, str]) -> tuple:
    """Renames of a BERT-like checkpoint: ``prefix`` (optional in the names, absent in a
    bare ``*Model``), ``layer`` (the blocks' path) and ``parts`` (their path in a block ->
    ours)."""
    p = rf"(?:{prefix}\.)?"
    return tuple((rf"{p}{layer}\.(\d+)\.{theirs}\.(.*)", rf"model.layers.\1.{ours}.\2") for theirs, ours in parts.items())


BERT_LAYER_PARTS = {
    r"attention\.self\.query": "self_attn.q_proj", r"attention\.self\.key": "self_attn.k_proj",
    r"attention\.self\.value": "self_attn.v_proj", r"attention\.output\.dense": "self_attn.o_proj",
    r"attention\.output\.LayerNorm": "input_layernorm", r"intermediate\.dense": "mlp.up_proj",
    r"output\.dense": "mlp.down_proj", r"output\.LayerNorm": "post_attention_layernorm",
}


def bert_embedding_renames(prefix: str) -> tuple:
    p = rf"(?:{prefix}\.)?"
    return (
        (rf"{p}embeddings\.word_embeddings\.(.*)", r"model.embed_tokens.\1"),
        (rf"{p}embeddings\.position_embeddings\.(.*)", r"model.embed_positions.\1"),
        (rf"{p}embeddings\.token_type_embeddings\.(.*)", r"model.embed_token_types.\1"),
        (rf"{p}embeddings\.LayerNorm\.(.*)", r"model.embed_norm.\1"),
        (rf"{p}embeddings\.(position_ids|token_type_ids)", None),
    )


BERT_RENAMES = (
    *bert_embedding_renames("bert"), *encoder_renames("bert", r"encoder\.layer", BERT_LAYER_PARTS),
    (r"(?:bert\.)?pooler\.dense\.(.*)", r"classifier.dense.\1"),  # BERT's classifier reads the pooler
    (r"cls\.predictions\.transform\.dense\.(.*)", r"lm_head.dense.\1"),
    (r"cls\.predictions\.transform\.LayerNorm\.(.*)", r"lm_head.norm.\1"),
    (r"cls\.predictions\.bias", r"lm_head.bias"),
    (r"cls\.predictions\.decoder\..*", None),  # tied to the word embeddings; its bias is the one above
    (r"cls\.seq_relationship\..*", None),  # next-sentence prediction
    (r"classifier\.(weight|bias)", r"classifier.out_proj.\1"),
)
ROBERTA_RENAMES = (
    *bert_embedding_renames("roberta"), *encoder_renames("roberta", r"encoder\.layer", BERT_LAYER_PARTS),
    (r"(?:roberta\.)?pooler\..*", None),  # RoBERTa's classifier has its own dense layer
    (r"lm_head\.layer_norm\.(.*)", r"lm_head.norm.\1"),
    (r"lm_head\.decoder\..*", None),
)
DISTILBERT_RENAMES = (
    *bert_embedding_renames("distilbert"),
    *encoder_renames("distilbert", r"transformer\.layer", {
        r"attention\.q_lin": "self_attn.q_proj", r"attention\.k_lin": "self_attn.k_proj",
        r"attention\.v_lin": "self_attn.v_proj", r"attention\.out_lin": "self_attn.o_proj",
        r"sa_layer_norm": "input_layernorm", r"ffn\.lin1": "mlp.up_proj", r"ffn\.lin2": "mlp.down_proj",
        r"output_layer_norm": "post_attention_layernorm",
    }),
    (r"vocab_transform\.(.*)", r"lm_head.dense.\1"),
    (r"vocab_layer_norm\.(.*)", r"lm_head.norm.\1"),
    (r"vocab_projector\.bias", r"lm_head.bias"),
    (r"vocab_projector\.weight", None),
    (r"pre_classifier\.(.*)", r"classifier.dense.\1"),
    (r"classifier\.(weight|bias)", r"classifier.out_proj.\1"),
)
MODERNBERT_RENAMES = (
    (r"(?:model\.)?embeddings\.tok_embeddings\.(.*)", r"model.embed_tokens.\1"),
    (r"(?:model\.)?embeddings\.norm\.(.*)", r"model.embed_norm.\1"),
    *encoder_renames("model", "layers", {
        r"attn_norm": "input_layernorm", r"attn\.Wqkv": "self_attn.qkv_proj", r"attn\.Wo": "self_attn.o_proj",
        r"mlp_norm": "post_attention_layernorm", r"mlp\.Wi": "mlp.gate_up_proj", r"mlp\.Wo": "mlp.down_proj",
    }),
    (r"(?:model\.)?final_norm\.(.*)", r"model.norm.\1"),
    (r"decoder\.bias", r"lm_head.bias"),
    (r"decoder\.weight", None),  # tied to the token embeddings
    (r"classifier\.(weight|bias)", r"classifier.out_proj.\1"),
)
T5_RENAMES = (
    (r"(encoder|decoder)\.embed_tokens\.weight", None),  # the shared table
    (r"(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.(.*)",
     r"\1.relative_attention_bias.\2"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.(q|k|v|o)\.(.*)", r"\1.layers.\2.self_attn.\3_proj.\4"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.layer_norm\.(.*)", r"\1.layers.\2.input_layernorm.\3"),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.(q|k|v|o)\.(.*)", r"decoder.layers.\1.cross_attn.\2_proj.\3"),
    (r"decoder\.block\.(\d+)\.layer\.1\.layer_norm\.(.*)", r"decoder.layers.\1.cross_attn_layernorm.\2"),
    (r"encoder\.block\.(\d+)\.layer\.1\.layer_norm\.(.*)", r"encoder.layers.\1.post_attention_layernorm.\2"),
    (r"decoder\.block\.(\d+)\.layer\.2\.layer_norm\.(.*)", r"decoder.layers.\1.post_attention_layernorm.\2"),
    *((rf"{stack}\.block\.(\d+)\.layer\.{sublayer}\.DenseReluDense\.{theirs}\.(.*)", rf"{stack}.layers.\1.mlp.{ours}.\2")
      for stack, sublayer in (("encoder", 1), ("decoder", 2))
      for theirs, ours in (("wi", "up_proj"), ("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))),
    (r"(encoder|decoder)\.final_layer_norm\.(.*)", r"\1.norm.\2"),
)


def drop_unbuilt_heads(weights: dict, args: ModelArgs) -> dict:
    """Keep the tensors of the head ``args.head`` builds, drop the other head's."""
    unbuilt = tuple(prefix for prefix, head in (("lm_head.", "masked_lm"), ("classifier.", "classification"))
                    if args.head != head)
    return {name: t for name, t in weights.items() if not name.startswith(unbuilt)}


def modernbert_rewrite(weights: dict, args: ModelArgs) -> dict:
    """ModernBERT's ``head`` is the classifier's dense layer and norm under a classifier
    and the masked-LM transform otherwise; fused Wqkv and Wi split by rows."""
    owner = "classifier." if args.head == "classification" else "lm_head."
    renamed = {(owner + name.removeprefix("head.") if name.startswith("head.") else name): t
               for name, t in weights.items()}
    F = args.intermediate_size
    split = split_rows(split_qkv(renamed, args), "gate_up_proj", {"gate_proj": F, "up_proj": F})
    return drop_unbuilt_heads(split, args)


def t5_rewrite(weights: dict, args: ModelArgs) -> dict:
    """An untied head that a checkpoint leaves out is the shared table, as transformers
    ties it then."""
    if not args.tie_word_embeddings and "lm_head.weight" not in weights and "shared.weight" in weights:
        return {**weights, "lm_head.weight": weights["shared.weight"]}
    return weights


# Encoders (kind "encoder") and encoder-decoders (kind "encoder-decoder"), by model_type.
ENCODERS: dict[str, Architecture] = {
    "bert": Architecture(args=bert_args, renames=BERT_RENAMES, rewrite=drop_unbuilt_heads),
    "roberta": Architecture(args=roberta_args, renames=ROBERTA_RENAMES, rewrite=drop_unbuilt_heads),
    "xlm-roberta": Architecture(args=roberta_args, renames=ROBERTA_RENAMES, rewrite=drop_unbuilt_heads),
    "distilbert": Architecture(args=distilbert_args, renames=DISTILBERT_RENAMES, rewrite=drop_unbuilt_heads),
    "modernbert": Architecture(args=modernbert_args, renames=MODERNBERT_RENAMES, rewrite=modernbert_rewrite),
    "t5": Architecture(args=t5_args, renames=T5_RENAMES, rewrite=t5_rewrite),  # t5, t5 v1.1, flan-t5
    "mt5": Architecture(args=t5_args, renames=T5_RENAMES, rewrite=t5_rewrite),
}
