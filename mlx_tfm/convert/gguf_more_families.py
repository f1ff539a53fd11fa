"""llama.cpp's GGUF files of still more families, under llama.cpp's architecture names:
gpt-oss, gpt2, starcoder (StarCoder 1, gpt_bigcode), gptj, read back into the names their
families load (``mlx_tfm.families``).

Each row of ``MORE_FAMILY_ARCHITECTURES`` holds the fields of one ``GGUFArchitecture``
(``gguf_file.py`` builds them), as ``gguf_families.py``'s rows do. What llama.cpp's
converters did to the tensors, and how it is read back:

- gpt-oss: the experts' interleaved ``gate_up_proj`` (experts, D, 2F) is written split
  (even columns gate, odd up) and transposed, ``down_proj`` transposed: mlx-lm's stacked
  (experts, out, in) layout under ``mlp.experts.*``, which the family loads as it is;
  the sinks gain a ``.weight`` (dropped again). llama.cpp runs every other layer sliding,
  layer 0 first, as the checkpoints do.
- gpt2: GPT-2's Conv1D weights (in, out) are written transposed, as Linear (out, in)
  weights: read into mlx-lm's gpt2 layout (``model.h.N...``), which holds them so.
- starcoder, gptj: the tensors as the checkpoint holds them, the fused ``c_attn`` of
  StarCoder kept fused (its family splits it).
- GPT-2, StarCoder and GPT-J converters write 4 x hidden as the feed-forward length
  whatever the model has: the up projection's shape tells.
"""

from __future__ import annotations

import numpy as np

from .gguf_families import HEAD, layer_pairs

NamePair = tuple[str, str]


def layer_names(prefix: str, pairs: list[tuple[str, str]]) -> tuple[NamePair, ...]:
    """``blk.N.{gguf}.weight|bias`` <-> ``{prefix}.N.{hf}.weight|bias`` for each pair."""
    return tuple((f"blk.{{layer}}.{g}.{{kind}}", f"{prefix}.{{layer}}.{h}.{{kind}}") for g, h in pairs)


def up_width(tensors: dict) -> int:
    """The feed-forward width from ``blk.0.ffn_up`` (ggml order: in, out)."""
    return int(tensors["blk.0.ffn_up.weight"].shape[1])


# -- gpt-oss: attention sinks, sliding layers, experts with biases ---------------------------

GPT_OSS_NAMES = HEAD + (
    # the converter names the sinks a weight; restore_gpt_oss drops the suffix again
    ("blk.{layer}.attn_sinks.weight", "model.layers.{layer}.self_attn.sinks.weight"),
) + layer_pairs([
    ("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"), ("ffn_gate_inp", "mlp.router"),
    ("ffn_gate_exps", "mlp.experts.gate_proj"), ("ffn_up_exps", "mlp.experts.up_proj"),
    ("ffn_down_exps", "mlp.experts.down_proj"),
])


def gpt_oss_keys(get, base: dict, tensors: dict) -> dict:
    """GptOssModel writes the experts' width as expert_feed_forward_length and the window;
    llama.cpp makes even layers slide."""
    n_layers = base["num_hidden_layers"]
    return {
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": int(get("expert_feed_forward_length")),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
    }


def restore_gpt_oss(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    return {name.removesuffix(".weight") if name.endswith(".self_attn.sinks.weight") else name: data}


# -- GPT-2 and StarCoder 1: learned positions, LayerNorms, a fused qkv -----------------------

GPT2_NAMES = (
    ("token_embd.weight", "model.wte.weight"),
    ("position_embd.weight", "model.wpe.weight"),
    ("output_norm.{kind}", "model.ln_f.{kind}"),
    ("output.weight", "lm_head.weight"),
) + layer_names("model.h", [
    ("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_norm", "ln_2"),
    ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj"),
])
STARCODER_NAMES = tuple((g, "transformer." + h.removeprefix("model.")) if h.startswith("model.") else (g, h)
                        for g, h in GPT2_NAMES)


def gpt2_keys(get, base: dict, tensors: dict) -> dict:
    """GPT2Model writes GPT-2's own keys' values: widths, layers, heads, context, eps."""
    return {
        "n_embd": int(get("embedding_length")),
        "n_layer": int(get("block_count")),
        "n_head": int(get("attention.head_count")),
        "n_positions": int(get("context_length")),
        "n_inner": up_width(tensors),
        "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
    }


def starcoder_keys(get, base: dict, tensors: dict) -> dict:
    """StarCoderModel: GPT-2's keys and one KV head (multi-query) or as many as queries."""
    n_heads = int(get("attention.head_count"))
    return {**gpt2_keys(get, base, tensors), "multi_query": int(get("attention.head_count_kv", n_heads)) == 1}


# -- GPT-J: attention and MLP side by side, RoPE over adjacent pairs of the first dims -------

GPTJ_NAMES = (
    ("token_embd.weight", "transformer.wte.weight"),
    ("output_norm.{kind}", "transformer.ln_f.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
) + layer_names("transformer.h", [
    ("attn_norm", "ln_1"), ("attn_q", "attn.q_proj"), ("attn_k", "attn.k_proj"), ("attn_v", "attn.v_proj"),
    ("attn_output", "attn.out_proj"), ("ffn_up", "mlp.fc_in"), ("ffn_down", "mlp.fc_out"),
])


def gptj_keys(get, base: dict, tensors: dict) -> dict:
    """GPTJModel: GPT-2's keys and the rotated dims of a head (rotary_dim)."""
    return {**gpt2_keys(get, base, tensors), "rotary_dim": int(get("rope.dimension_count"))}


def as_written(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """The tensor as the file holds it (a fused qkv left for the family to split)."""
    return {name: data}


def standalone(model_type: str, hf_architecture: str, names, config, restore=None) -> dict:
    """A row whose config reader builds the family's whole config (no llama-shaped keys)."""
    return dict(model_type=model_type, hf_architecture=hf_architecture, names=names, config=config,
                restore=restore, standalone=True)


MORE_FAMILY_ARCHITECTURES = {
    "gpt-oss": dict(model_type="gpt_oss", hf_architecture="GptOssForCausalLM", names=GPT_OSS_NAMES,
                    config=gpt_oss_keys, restore=restore_gpt_oss),
    "gpt2": standalone("gpt2", "GPT2LMHeadModel", GPT2_NAMES, gpt2_keys, restore=as_written),
    "starcoder": standalone("gpt_bigcode", "GPTBigCodeForCausalLM", STARCODER_NAMES, starcoder_keys,
                            restore=as_written),
    "gptj": standalone("gptj", "GPTJForCausalLM", GPTJ_NAMES, gptj_keys),
}
