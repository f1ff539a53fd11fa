"""GGUF files (llama.cpp), read with the ``gguf`` package.

Q8_0, Q4_0 and Q4_1 blocks (32 weights, one float16 scale, Q4_1 also an offset) are
exactly MLX affine quantization with group size 32, so the most common of them is carried
over bit for bit; every other tensor is decoded to float. The tokenizer metadata becomes a
``tokenizer.model`` for a SentencePiece-style ("llama") vocabulary, a ``tokenizer.json``
for a GPT-2-style byte-level BPE ("gpt2") one, split as the family's own tokenizer.json
splits (``PRE_TOKENIZERS``).

Architectures: one row of ``GGUF_ARCHITECTURES`` each, saying which Hugging Face model the
file becomes, how llama.cpp's tensor names map onto its names, and what llama.cpp's
converter did to the tensors that must be undone: Llama-lineage converters permute q/k
rows into interleaved-RoPE order, Gemma's add 1 to every norm weight. The hybrid families'
rows (short convolutions, Mamba and Mamba-2 mixers) live in ``gguf_hybrids.py``: they build
their whole config and restore their tensors' layout (``GGUFArchitecture.restore``); more
families' rows (GPT-NeoX, Cohere 2, Llama 4, Gemma 4, Apertus...) in ``gguf_families.py``.

Mixtures of experts (qwen3moe; Mixtral, which llama.cpp writes as a ``llama`` with
``expert_count`` set): llama.cpp stacks each projection's experts into one tensor,
``blk.N.ffn_{gate,up,down}_exps.weight``, (experts, out, in) as numpy reads it, which is
mlx-lm's stacked layout already; older Mixtral files hold one tensor per expert,
``blk.N.ffn_gate.E.weight``, which become Hugging Face's per-expert names and are stacked
by the family's own expert layout (``mlx_tfm.families``). Quantized experts are blocks per
row like a matrix's, so Q8_0 / Q4_0 / Q4_1 experts are carried over exactly too.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from ..errors import UserError
from ..families.experts import (
    MIXTRAL_EXPERT_PROJECTIONS,
    QWEN_EXPERT_PROJECTIONS,
    num_experts_of,
)
from .gguf_encoders import ENCODER_ARCHITECTURES, bert_tokenizer, sentencepiece_pieces, unigram_tokenizer
from .gguf_families import (
    FAMILY_ARCHITECTURES,
    gemma4_tokenizer,
    llama3_scaling_keys,
    tokenizer_json_files,
)
from .gguf_hybrids import HYBRID_ARCHITECTURES
from .gguf_more_families import MORE_FAMILY_ARCHITECTURES
from .gguf_qwen_next import QWEN_NEXT_ARCHITECTURES
from .llama2c import interleaved_to_half_split
from .sources import Source

# -- tensor names: llama.cpp's <-> Hugging Face's ----------------------------------------------
# Each row pairs a llama.cpp name with the Hugging Face name it becomes, as templates:
# {layer} and {expert} stand for numbers, {kind} for weight or bias. The rows read both
# ways: ``hf_name`` (reading a GGUF file) and ``gguf_name`` (writing one, as the tests'
# and benchmarks' llama.cpp-style files do). The first matching row wins.

NamePair = tuple[str, str]  # (llama.cpp template, Hugging Face template)
PLACEHOLDERS = {"layer": r"\d+", "expert": r"\d+", "kind": r"weight|bias"}


def per_layer(gguf_part: str, hf_part: str) -> NamePair:
    """``blk.N.{gguf_part}.weight|bias`` <-> ``model.layers.N.{hf_part}.weight|bias``."""
    return f"blk.{{layer}}.{gguf_part}.{{kind}}", f"model.layers.{{layer}}.{hf_part}.{{kind}}"


EMBEDDING_AND_HEAD = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.{kind}", "model.norm.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
)
ATTENTION = tuple(per_layer(g, h) for g, h in [
    ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
    ("attn_qkv", "self_attn.qkv_proj"),  # fused (older Phi-2 files): split by rows on reading
    ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
])
GATED_MLP = tuple(per_layer(g, h) for g, h in [
    ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
])
PRE_NORMS = (per_layer("attn_norm", "input_layernorm"), per_layer("ffn_norm", "post_attention_layernorm"))
POST_NORMS = (per_layer("post_attention_norm", "post_attention_layernorm"),
              per_layer("post_ffw_norm", "post_feedforward_layernorm"))

LLAMA_NAMES = EMBEDDING_AND_HEAD + ATTENTION + PRE_NORMS + GATED_MLP
# Gemma 3: llama.cpp's ffn_norm is the norm before the MLP, the post norms follow each sublayer.
GEMMA3_NAMES = EMBEDDING_AND_HEAD + ATTENTION + GATED_MLP + POST_NORMS + (
    per_layer("attn_norm", "input_layernorm"), per_layer("ffn_norm", "pre_feedforward_layernorm"))
OLMO2_NAMES = EMBEDDING_AND_HEAD + ATTENTION + GATED_MLP + POST_NORMS
STARCODER2_NAMES = EMBEDDING_AND_HEAD + ATTENTION + PRE_NORMS + (
    per_layer("ffn_up", "mlp.c_fc"), per_layer("ffn_down", "mlp.c_proj"))
PHI2_NAMES = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.{kind}", "model.final_layernorm.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
    per_layer("attn_output", "self_attn.dense"),
    *ATTENTION,
    per_layer("attn_norm", "input_layernorm"),
    per_layer("ffn_up", "mlp.fc1"),
    per_layer("ffn_down", "mlp.fc2"),
)


def expert_names(block: str, hf_projections: dict[str, str]) -> tuple[NamePair, ...]:
    """A mixture-of-experts layer: the router ``ffn_gate_inp`` -> ``{block}.gate``; stacked
    experts ``blk.N.ffn_gate_exps.weight`` -> ``model.layers.N.{block}.switch_mlp.gate_proj.weight``;
    one tensor per expert (older files) ``blk.N.ffn_gate.E.weight`` -> the Hugging Face
    per-expert name ``model.layers.N.{block}.experts.E.{projection}.weight``, where
    ``hf_projections`` is the family's (Hugging Face projection -> stacked projection) table."""
    ours = {stacked: hf for hf, stacked in hf_projections.items()}
    names = [per_layer("ffn_gate_inp", f"{block}.gate")]
    for gguf_part, stacked in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
        names.append((f"blk.{{layer}}.{gguf_part}_exps.weight",
                      f"model.layers.{{layer}}.{block}.switch_mlp.{stacked}.weight"))
        names.append((f"blk.{{layer}}.{gguf_part}.{{expert}}.weight",
                      f"model.layers.{{layer}}.{block}.experts.{{expert}}.{ours[stacked]}.weight"))
    return tuple(names)


QWEN3MOE_NAMES = LLAMA_NAMES + expert_names("mlp", QWEN_EXPERT_PROJECTIONS)
# A llama file with experts is Mixtral (see llama_keys); a dense one never holds these tensors.
# Llama 3.x files carry their RoPE scaling as a tensor of per-frequency factors (rope_freqs)
LLAMA_OR_MIXTRAL_NAMES = (LLAMA_NAMES + (("rope_freqs.weight", "rope_freqs.weight"),)
                          + expert_names("block_sparse_moe", MIXTRAL_EXPERT_PROJECTIONS))


# -- configs: llama.cpp's metadata -> Hugging Face config keys, per family ----------------------
# ``get(key, default)`` reads ``{arch}.{key}``; ``base`` is what every family shares (hf_config).


def no_keys(get, base: dict, tensors: dict) -> dict:
    return {}


def llama_keys(get, base: dict, tensors: dict) -> dict:
    """llama.cpp writes Mixtral as a llama with experts; Mixtral routes by softmax over all
    experts, the top k renormalised (no flag: mixtral_args), as llama.cpp's llama does."""
    n_experts = int(get("expert_count") or 0)
    if not n_experts:
        return llama3_scaling_keys(base, tensors)  # Llama 3.x: solved back from rope_freqs
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": n_experts,
        "num_experts_per_tok": int(get("expert_used_count")),
    }


def gemma3_keys(get, base: dict, tensors: dict) -> dict:
    """llama.cpp's Gemma 3: every sixth layer global, local layers at base 10000 unscaled,
    scores scaled by 1/sqrt(head_dim) (27B, 62 layers: 1/sqrt(hidden / heads))."""
    n_layers, head_dim = base["num_hidden_layers"], base["head_dim"]
    pattern = get("attention.sliding_window_pattern")
    sliding = pattern if isinstance(pattern, list) else [(i + 1) % (pattern or 6) != 0 for i in range(n_layers)]
    scalar = base["hidden_size"] // base["num_attention_heads"] if n_layers == 62 else head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": get("final_logit_softcapping"),
    }


def olmo2_keys(get, base: dict, tensors: dict) -> dict:
    """OLMo 3 files say ``olmo2`` too; their sliding window and per-layer pattern tell them apart."""
    window = get("attention.sliding_window")
    if window is None:
        return {}
    n_layers = base["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern") or [(i + 1) % 4 != 0 for i in range(n_layers)]
    return {
        "model_type": "olmo3",
        "architectures": ["Olmo3ForCausalLM"],
        "sliding_window": int(window),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in pattern],
        # llama.cpp rotates both layer types with the file's one base: say so per type, as
        # an older-layout config would give the sliding layers transformers 5's default base
        "rope_local_base_freq": base["rope_theta"],
    }


def starcoder2_keys(get, base: dict, tensors: dict) -> dict:
    keys = {
        "norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
        "use_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "gelu_pytorch_tanh",
    }
    if get("attention.sliding_window"):
        keys["sliding_window"] = int(get("attention.sliding_window"))
    return keys


def granite_keys(get, base: dict, tensors: dict) -> dict:
    """The converter writes each multiplier only when set; llama.cpp then uses the plain value."""
    return {
        "attention_multiplier": float(get("attention.scale") or base["head_dim"] ** -0.5),
        "embedding_multiplier": float(get("embedding_scale") or 1.0),
        "residual_multiplier": float(get("residual_scale") or 1.0),
        "logits_scaling": float(get("logit_scale") or 1.0),
    }


def phi2_keys(get, base: dict, tensors: dict) -> dict:
    """Phi2Model writes 4 x hidden as the feed-forward length whatever the model has; the
    fc1 tensor (shape in ggml order: in, out) tells."""
    rotary = get("rope.dimension_count", base["head_dim"])
    return {
        "intermediate_size": int(tensors["blk.0.ffn_up.weight"].shape[1]),
        "partial_rotary_factor": int(rotary) / base["head_dim"],
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
        "hidden_act": "gelu_new",
    }


def qwen3moe_keys(get, base: dict, tensors: dict) -> dict:
    return {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "norm_topk_prob": True,  # llama.cpp's qwen3moe always renormalises the chosen experts
    }


# -- DeepSeek-V2/V3 (llama.cpp's deepseek2; Kimi K2, Moonlight): multi-head latent attention --
# llama.cpp's converter keeps kv_b_proj (attn_kv_b) or, in newer files, splits it per head
# into attn_k_b (H, R, nope) and attn_v_b (H, v, R): our embed_q and unembed_out as they are.
DEEPSEEK2_NAMES = EMBEDDING_AND_HEAD + PRE_NORMS + GATED_MLP + tuple(per_layer(g, h) for g, h in [
    ("attn_q", "self_attn.q_proj"), ("attn_q_a", "self_attn.q_a_proj"), ("attn_q_b", "self_attn.q_b_proj"),
    ("attn_q_a_norm", "self_attn.q_a_layernorm"), ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
    ("attn_kv_a_norm", "self_attn.kv_a_layernorm"), ("attn_kv_b", "self_attn.kv_b_proj"),
    ("attn_k_b", "self_attn.embed_q"), ("attn_v_b", "self_attn.unembed_out"), ("attn_output", "self_attn.o_proj"),
    ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"), ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
    ("ffn_down_shexp", "mlp.shared_experts.down_proj"),
]) + (("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.mlp.gate.e_score_correction_bias"),
      ) + expert_names("mlp", QWEN_EXPERT_PROJECTIONS)


def deepseek2_keys(get, base: dict, tensors: dict) -> dict:
    """Sigmoid gating (expert_gating_func 2) is DeepSeek-V3's router, softmax V2's. Newer
    files give the per-head widths as key_length_mla / value_length_mla (key_length then
    being the cached latent's) and one KV head; the query heads are what MLA has."""
    rope_dim = int(get("rope.dimension_count"))
    key_length = int(get("attention.key_length_mla") or get("attention.key_length"))
    sigmoid = int(get("expert_gating_func") or 1) == 2
    n_group = int(get("expert_group_count") or 1)
    return {
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": base["num_attention_heads"],
        "q_lora_rank": int(get("attention.q_lora_rank") or 0) or None,
        "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length - rope_dim,
        "v_head_dim": int(get("attention.value_length_mla") or get("attention.value_length")),
        "n_routed_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count") or 0),
        "first_k_dense_replace": int(get("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm") or False),
        "n_group": n_group,
        "topk_group": int(get("expert_group_used_count") or 1),
        "topk_method": "noaux_tc" if sigmoid else ("group_limited_greedy" if n_group > 1 else "greedy"),
        "rope_interleave": True,  # llama.cpp's deepseek2 rotates adjacent pairs, as the checkpoints
    }


# -- GLM-4 (llama4 branch): llama.cpp keeps the fused gate_up_proj as ffn_up, q/k rows as
# they are (its GLM-4 rotates adjacent pairs too), and names GLM-4's four norms apart.
GLM4_NAMES = EMBEDDING_AND_HEAD + ATTENTION + (
    per_layer("attn_norm", "input_layernorm"), per_layer("ffn_norm", "post_attention_layernorm"),
    per_layer("post_attention_norm", "post_self_attn_layernorm"), per_layer("post_ffw_norm", "post_mlp_layernorm"),
    per_layer("ffn_up", "mlp.gate_up_proj"), per_layer("ffn_down", "mlp.down_proj"))


def glm4_keys(get, base: dict, tensors: dict) -> dict:
    """Glm4Model writes the rotated dims of each head (half of it by default)."""
    rotary = get("rope.dimension_count", base["head_dim"] // 2)
    return {"partial_rotary_factor": int(rotary) / base["head_dim"], "attention_bias": "blk.0.attn_q.bias" in tensors}


# -- more families (mlx_tfm/families/more_decoders.py) --
UNGATED_PRE_NORM_NAMES = EMBEDDING_AND_HEAD + ATTENTION + PRE_NORMS + (
    per_layer("ffn_up", "mlp.up_proj"), per_layer("ffn_down", "mlp.down_proj"))


def ernie4_5_keys(get, base: dict, tensors: dict) -> dict:
    return {"use_bias": "blk.0.attn_q.bias" in tensors}


def nemotron_keys(get, base: dict, tensors: dict) -> dict:
    """NemotronModel writes the rotated dims of a head and LayerNorm1P's weights plus 1
    (llama.cpp's plain LayerNorm then computes the same)."""
    rotary = get("rope.dimension_count", base["head_dim"])
    return {
        "partial_rotary_factor": int(rotary) / base["head_dim"],
        "norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
        "hidden_act": "relu2",
    }


def hunyuan_dense_keys(get, base: dict, tensors: dict) -> dict:
    """HunYuanModel folds NTK-alpha into the base it writes (no scaling type): a plain base
    here; q/k norm after RoPE is the family's own."""
    return {"use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}


# -- Granite MoE (granitemoe, granitemoeshared) and ERNIE 4.5 MoE: experts as llama.cpp stacks
# them, Granite's multipliers (granite_keys), ERNIE's dense leading layers
GRANITEMOE_NAMES = LLAMA_NAMES + (
    per_layer("ffn_gate_inp", "block_sparse_moe.router.layer"),
    per_layer("ffn_gate_exps", "block_sparse_moe.switch_mlp.gate_proj"),
    per_layer("ffn_up_exps", "block_sparse_moe.switch_mlp.up_proj"),
    per_layer("ffn_down_exps", "block_sparse_moe.switch_mlp.down_proj"),
    # the shared MLP as the converter splits its input_linear (in the names the family takes)
    per_layer("ffn_gate_shexp", "mlp.shared_expert.gate_proj"), per_layer("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    per_layer("ffn_down_shexp", "shared_mlp.output_linear"),
)


def granitemoe_keys(get, base: dict, tensors: dict) -> dict:
    """GraniteMoeModel: a shared MLP (granitemoeshared) when the file gives its width."""
    shared = get("expert_shared_feed_forward_length")
    keys = {
        **granite_keys(get, base, tensors),
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
    }
    if shared:
        keys.update(model_type="granitemoeshared", architectures=["GraniteMoeSharedForCausalLM"],
                    shared_intermediate_size=int(shared))
    return keys


ERNIE4_5_MOE_NAMES = LLAMA_NAMES + expert_names("mlp", QWEN_EXPERT_PROJECTIONS) + tuple(per_layer(g, h) for g, h in [
    ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"), ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
    ("ffn_down_shexp", "mlp.shared_experts.down_proj"),
]) + (("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.mlp.moe_statics.e_score_correction_bias"),)


def ernie4_5_moe_keys(get, base: dict, tensors: dict) -> dict:
    """Ernie4_5MoeModel writes the leading dense layers and the step between expert layers,
    no last expert layer: llama.cpp's experts run to the last layer."""
    first, step = int(get("leading_dense_block_count") or 0), int(get("interleave_moe_layer_step") or 1)
    return {
        **ernie4_5_keys(get, base, tensors),
        "moe_num_experts": int(get("expert_count")),
        "moe_k": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "moe_num_shared_experts": int(get("expert_shared_count") or 0),
        "moe_layer_start_index": first,
        "moe_layer_end_index": base["num_hidden_layers"] - 1,
        "moe_layer_interval": step,
        "first_k_dense_replace": first, "interleave_moe_layer_step": step,  # where check_experts looks
    }


# -- Gemma and Gemma 2: norms stored as 1 + w (norm_shift), GELU (tanh), base 10000 unwritten
def gemma_keys(get, base: dict, tensors: dict) -> dict:
    return {"hidden_activation": "gelu_pytorch_tanh"}


def gemma2_keys(get, base: dict, tensors: dict) -> dict:
    """llama.cpp's Gemma 2: even layers slide (window 4096 unless written), scores scaled by
    1/sqrt(head_dim) (27B, 46 layers: 1/sqrt(hidden / heads)), both soft caps."""
    n_layers = base["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    sliding = pattern if isinstance(pattern, list) else [i % (pattern or 2) < (pattern or 2) - 1 for i in range(n_layers)]
    scalar = base["hidden_size"] // base["num_attention_heads"] if n_layers == 46 else base["head_dim"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(get("attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
    }


# -- Qwen2-MoE: qwen3moe's experts beside a shared expert behind its own sigmoid gate
QWEN2MOE_NAMES = QWEN3MOE_NAMES + tuple(per_layer(g, h) for g, h in [
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"), ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"), ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
])


def qwen2moe_keys(get, base: dict, tensors: dict) -> dict:
    """Qwen2MoeModel: every layer a mixture; llama.cpp's qwen2moe renormalises no weights."""
    return {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length") or 0),
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    }


# -- OLMoE: qwen3moe's experts with q/k norms over all heads; Arcee: an ungated ReLU² MLP
def olmoe_keys(get, base: dict, tensors: dict) -> dict:
    """OlmoeModel: every layer a mixture, the chosen weights not renormalised."""
    return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
            "norm_topk_prob": False}


def arcee_keys(get, base: dict, tensors: dict) -> dict:
    return {"hidden_act": "relu2"}


# -- Phi-3: fused qkv and gate_up kept fused (the family splits them), Phi-4's window 0 = none
PHI3_NAMES = EMBEDDING_AND_HEAD + PRE_NORMS + (per_layer("ffn_up", "mlp.gate_up_proj"),) + ATTENTION + GATED_MLP


def phi3_keys(get, base: dict, tensors: dict) -> dict:
    rotary = get("rope.dimension_count", base["head_dim"])
    window = get("attention.sliding_window")
    return {"partial_rotary_factor": int(rotary) / base["head_dim"], "sliding_window": int(window) if window else None}


def keep_fused(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    return {name: data}


# -- GLM-4.5 (glm4moe): DeepSeek-V3's sigmoid routing over groups beside shared experts, partial
# RoPE over halves; the converter appends the multi-token-prediction layers, dropped here
GLM4MOE_NAMES = EMBEDDING_AND_HEAD + ATTENTION + GATED_MLP + (  # its norm before the MLP: post_attention_norm
    per_layer("attn_norm", "input_layernorm"), per_layer("post_attention_norm", "post_attention_layernorm"),
) + expert_names("mlp", QWEN_EXPERT_PROJECTIONS) + tuple(per_layer(g, h) for g, h in [
    ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"), ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
    ("ffn_down_shexp", "mlp.shared_experts.down_proj"),
]) + (("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.mlp.gate.e_score_correction_bias"),)


def glm4moe_keys(get, base: dict, tensors: dict) -> dict:
    head_dim = base["head_dim"]
    return {
        "num_hidden_layers": base["num_hidden_layers"] - int(get("nextn_predict_layers") or 0),
        "partial_rotary_factor": int(get("rope.dimension_count", head_dim // 2)) / head_dim,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "n_routed_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count") or 0),
        "first_k_dense_replace": int(get("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm") or False),
        "n_group": int(get("expert_group_count") or 1),
        "topk_group": int(get("expert_group_used_count") or 1),
    }


def without_nextn_layers(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """The multi-token-prediction layers (past num_hidden_layers) are no part of the model."""
    match = re.match(r"(?:blk|model\.layers)\.(\d+)\.", name)
    return {} if match and int(match.group(1)) >= config["num_hidden_layers"] else {name: data}


# -- MiniMax-M2: Mixtral's experts chosen by sigmoid scores plus a learned bias, q/k norm over
# the whole projection, partial RoPE over halves
MINIMAX_M2_NAMES = LLAMA_OR_MIXTRAL_NAMES + (
    ("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.block_sparse_moe.e_score_correction_bias"),)


def minimax_m2_keys(get, base: dict, tensors: dict) -> dict:
    return {
        "partial_rotary_factor": int(get("rope.dimension_count", base["head_dim"])) / base["head_dim"],
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "intermediate_size": int(get("expert_feed_forward_length")),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
    }


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str  # the Hugging Face model_type it becomes
    hf_architecture: str
    names: tuple[NamePair, ...] = LLAMA_NAMES
    config: Callable = field(default=no_keys)  # family config keys (see above)
    permuted_qk: bool = False  # llama.cpp's Llama-lineage converters store q/k rows interleaved
    norm_shift: float = 0.0  # Gemma: llama.cpp stores every norm weight plus this
    # (Hugging Face name, data, config) -> {name: data}, undoing the converter's layout;
    # None: split_fused_qkv. Hybrids (gguf_hybrids.py) restore A_log, conv weights...
    restore: Callable | None = None
    standalone: bool = False  # config builds the whole family config: no llama-shaped base
    # (metadata, config) -> {name: mx.array}: weights a converter wrote as metadata (Apertus's xIELU)
    metadata_tensors: Callable | None = None
    own_expert_check: bool = False  # config checks the experts (nemotron_h_moe: only on its E layers, ungated)


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", LLAMA_OR_MIXTRAL_NAMES, llama_keys, permuted_qk=True,
                              restore=lambda name, data, config: {} if name == "rope_freqs.weight"
                              else split_fused_qkv(name, data, config)),  # the factors are in the config
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", QWEN3MOE_NAMES, qwen3moe_keys),
    "gemma3": GGUFArchitecture("gemma3_text", "Gemma3ForCausalLM", GEMMA3_NAMES, gemma3_keys, norm_shift=1.0),
    "olmo2": GGUFArchitecture("olmo2", "Olmo2ForCausalLM", OLMO2_NAMES, olmo2_keys),
    "starcoder2": GGUFArchitecture("starcoder2", "Starcoder2ForCausalLM", STARCODER2_NAMES, starcoder2_keys),
    "granite": GGUFArchitecture("granite", "GraniteForCausalLM", config=granite_keys, permuted_qk=True),
    "smollm3": GGUFArchitecture("smollm3", "SmolLM3ForCausalLM", permuted_qk=True),  # every 4th layer unrotated
    "phi2": GGUFArchitecture("phi", "PhiForCausalLM", PHI2_NAMES, phi2_keys),
    "deepseek2": GGUFArchitecture("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK2_NAMES, deepseek2_keys),
    "glm4": GGUFArchitecture("glm4", "Glm4ForCausalLM", GLM4_NAMES, glm4_keys),
    # -- more families --
    "ernie4_5": GGUFArchitecture("ernie4_5", "Ernie4_5ForCausalLM", config=ernie4_5_keys),  # RoPE over pairs: unpermuted
    "nemotron": GGUFArchitecture("nemotron", "NemotronForCausalLM", UNGATED_PRE_NORM_NAMES, nemotron_keys,
                                 norm_shift=1.0),
    "hunyuan-dense": GGUFArchitecture("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", config=hunyuan_dense_keys),
    **{arch: GGUFArchitecture(**fields) for arch, fields in HYBRID_ARCHITECTURES.items()},
    **{arch: GGUFArchitecture(**fields) for arch, fields in QWEN_NEXT_ARCHITECTURES.items()},  # Gated DeltaNet hybrids
    "qwen2moe": GGUFArchitecture("qwen2_moe", "Qwen2MoeForCausalLM", QWEN2MOE_NAMES, qwen2moe_keys),
    "olmoe": GGUFArchitecture("olmoe", "OlmoeForCausalLM", QWEN3MOE_NAMES, olmoe_keys),
    "arcee": GGUFArchitecture("arcee", "ArceeForCausalLM", UNGATED_PRE_NORM_NAMES, arcee_keys, permuted_qk=True),
    "phi3": GGUFArchitecture("phi3", "Phi3ForCausalLM", PHI3_NAMES, phi3_keys, restore=keep_fused),
    "glm4moe": GGUFArchitecture("glm4_moe", "Glm4MoeForCausalLM", GLM4MOE_NAMES, glm4moe_keys,
                                restore=without_nextn_layers),
    "minimax-m2": GGUFArchitecture("minimax_m2", "MiniMaxM2ForCausalLM", MINIMAX_M2_NAMES, minimax_m2_keys),
    "gemma": GGUFArchitecture("gemma", "GemmaForCausalLM", config=gemma_keys, norm_shift=1.0),
    "gemma2": GGUFArchitecture("gemma2", "Gemma2ForCausalLM", GEMMA3_NAMES, gemma2_keys, norm_shift=1.0),
    "granitemoe": GGUFArchitecture("granitemoe", "GraniteMoeForCausalLM", GRANITEMOE_NAMES, granitemoe_keys,
                                   permuted_qk=True),
    "ernie4_5-moe": GGUFArchitecture("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", ERNIE4_5_MOE_NAMES, ernie4_5_moe_keys),
    # -- gptneox, cohere2, command-r, llama4, gemma4, apertus, seed_oss, exaone4, stablelm (gguf_families.py) --
    **{arch: GGUFArchitecture(**fields) for arch, fields in FAMILY_ARCHITECTURES.items()},
    # -- gpt-oss, gpt2, starcoder, gptj... (gguf_more_families.py) --
    **{arch: GGUFArchitecture(**fields) for arch, fields in MORE_FAMILY_ARCHITECTURES.items()},
    **{arch: GGUFArchitecture(**fields) for arch, fields in ENCODER_ARCHITECTURES.items()},  # bert, t5
}


FLOAT_TYPES = ("F32", "F16", "BF16")
# Types MLX holds exactly: name -> bits (group size 32).
EXACT_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
# Types decoded to float with gguf's reference decoder.
DECODED_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")  # MXFP4: gpt-oss's experts
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
    family = GGUF_ARCHITECTURES[arch]
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    try:
        config = {
            "architectures": [family.hf_architecture],
            "model_type": family.model_type,
            "vocab_size": int(tensors["token_embd.weight"].shape[1]),
            "tie_word_embeddings": "output.weight" not in tensors,
        }
        if not family.standalone:
            config.update(llama_base(get))
        config.update(family.config(get, config, tensors))
    except (TypeError, KeyError, ValueError) as e:
        raise UserError(f"GGUF metadata lacks what a {arch} model needs ({e})") from None
    scaling = rope_scaling(get)
    if scaling and config.get("rope_scaling") is None:  # a family's own reading (mistral3's) wins
        config["rope_scaling"] = scaling
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{key}"])
    return config


def llama_base(get) -> dict:
    """The config keys of llama-shaped metadata (every family but the hybrids)."""
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    # written per layer by some (Gemma 4): the largest here, the family's keys say per layer
    largest = lambda value: max(value) if isinstance(value, list) else value  # noqa: E731
    return {
        "hidden_size": hidden,
        "intermediate_size": int(largest(get("feed_forward_length"))),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(largest(get("attention.head_count_kv", n_heads))),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
    }


def rope_scaling(get) -> dict | None:
    """llama.cpp's rope.scaling.* keys -> Hugging Face's rope_scaling (linear, YaRN)."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                   "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
        for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if get(key) is not None:
                scaling[hf_key] = float(get(key))
        if get("rope.scaling.yarn_log_multiplier"):  # deepseek2: 0.1 * mscale_all_dim (mscale the same)
            scaling["mscale"] = scaling["mscale_all_dim"] = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
        return scaling
    raise UserError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, yarn)")


@functools.cache
def template_pattern(template: str) -> re.Pattern:
    """A name template as a regex, each placeholder a named group."""
    parts = re.split(r"\{(\w+)\}", template)  # literal, placeholder, literal, ...
    return re.compile("".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>{PLACEHOLDERS[part]})"
                              for i, part in enumerate(parts)))


def renamed(name: str, pairs: tuple[NamePair, ...], to_gguf: bool) -> str | None:
    """``name`` through the first row of ``pairs`` whose source side matches it, or None."""
    for gguf_template, hf_template in pairs:
        source, target = (hf_template, gguf_template) if to_gguf else (gguf_template, hf_template)
        match = template_pattern(source).fullmatch(name)
        if match:
            return target.format(**match.groupdict())
    return None


def hf_name(name: str, arch: str) -> str:
    """The Hugging Face name of llama.cpp's tensor ``name`` in a file of ``arch``; a name
    the table lacks is left as is, so the strict check names it as unexpected."""
    return renamed(name, GGUF_ARCHITECTURES[arch].names, to_gguf=False) or name


def gguf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's name of the Hugging Face tensor ``name`` in a file of ``arch`` (the
    inverse of ``hf_name``, from the same table); ValueError for a tensor it has no name for."""
    found = renamed(name, GGUF_ARCHITECTURES[arch].names, to_gguf=True)
    if found is None:
        raise ValueError(f"{name} has no GGUF name in llama.cpp's {arch} layout")
    return found


def exact_type(tensors: dict) -> str | None:
    """The exactly-representable quantization type most matrices (and stacked experts) use
    (one per folder: config.json holds one bits/group_size)."""
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


def split_fused_qkv(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """``...qkv_proj.weight|bias`` rows -> q_proj, k_proj, v_proj (raw quantized rows too)."""
    if ".self_attn.qkv_proj." not in name:
        return {name: data}
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    if data.shape[0] != q_rows + 2 * kv_rows:
        raise UserError(f"GGUF tensor {name}: {data.shape[0]} rows, expected {q_rows + 2 * kv_rows} (q, k, v)")
    bounds = {"q_proj": (0, q_rows), "k_proj": (q_rows, q_rows + kv_rows), "v_proj": (q_rows + kv_rows, None)}
    return {name.replace("qkv_proj", part): data[start:stop] for part, (start, stop) in bounds.items()}


def decode_float(t, data: np.ndarray) -> mx.array:
    import gguf

    kind = t.tensor_type.name
    if kind == "BF16":
        return mx.array(gguf.quants.dequantize(data, t.tensor_type)).astype(mx.bfloat16)
    if kind in FLOAT_TYPES:
        return mx.array(np.ascontiguousarray(data))
    return mx.array(gguf.quants.dequantize(data, t.tensor_type).astype(np.float32))


def to_mlx_quantized(kind: str, data: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    """GGUF blocks (..., rows, n_blocks * block_bytes) -> MLX (packed uint32, scales,
    biases), each (..., rows, -1); stacked experts (experts, rows, bytes) are rows too.

    Q8_0: w = d * q, q int8    -> q + 128 unsigned, scale d, bias -128 d
    Q4_0: w = d * (q - 8)      -> scale d, bias -8 d
    Q4_1: w = d * q + m        -> scale d, bias m
    MLX packs values little-endian, element i of a uint32 at bits [i*bits, (i+1)*bits).
    """
    lead = data.shape[:-1]
    weight, scales, biases = quantized_rows(kind, data.reshape(-1, data.shape[-1]))  # (experts * rows, bytes)
    return tuple(mx.array(a.reshape(*lead, -1)) for a in (weight, scales, biases))


def quantized_rows(kind: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks (rows, n_blocks * block_bytes) -> (packed uint32, scales, biases) as numpy."""
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
    return weight, scales, biases


def check_tensor_types(reader, path: Path) -> None:
    supported = set(FLOAT_TYPES) | set(EXACT_TYPES) | set(DECODED_TYPES)
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise UserError(
                f"{path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(sorted(supported))})"
            )


def check_experts(tensors: dict, config: dict, path: Path) -> None:
    """Every layer of a mixture of experts holds each projection's experts, stacked or one
    tensor per expert, as many as the metadata's expert_count (all layers of qwen3moe and
    Mixtral are mixtures); or an error naming the tensor."""
    n_experts = num_experts_of(config)
    if not n_experts:
        return
    first, step = config.get("first_k_dense_replace") or 0, config.get("interleave_moe_layer_step") or 1
    # dense layers first, and (Llama 4, ERNIE) between: experts where (layer + 1) % step == 0
    for layer in [i for i in range(first, config["num_hidden_layers"]) if (i + 1) % step == 0]:
        fused = f"blk.{layer}.ffn_gate_up_exps.weight" in tensors  # Gemma 4: gate and up in one
        for projection in ("ffn_gate_up", "ffn_down") if fused else ("ffn_gate", "ffn_up", "ffn_down"):
            check_layer_experts(tensors, f"blk.{layer}.{projection}", n_experts, path)


def check_layer_experts(tensors: dict, prefix: str, n_experts: int, path: Path) -> None:
    stacked = f"{prefix}_exps.weight"
    if stacked in tensors:
        shape = tensors[stacked].data.shape  # (experts, out, in), or (experts, out, bytes) when quantized
        if len(shape) != 3 or shape[0] != n_experts:
            held = shape[0] if len(shape) == 3 else 1
            raise UserError(f"{path}: GGUF tensor {stacked} holds {held} experts, the metadata says {n_experts}")
        return
    missing = [f"{prefix}.{e}.weight" for e in range(n_experts) if f"{prefix}.{e}.weight" not in tensors]
    if len(missing) == n_experts:
        raise UserError(f"{path}: GGUF file lacks {stacked} (the layer's {n_experts} experts; "
                        f"nor does it hold them one per expert, {prefix}.0.weight ...)")
    if missing:
        raise UserError(f"{path}: GGUF file lacks {missing[0]} (one of the layer's {n_experts} experts)")


def read_tensors(reader, config: dict, arch: str) -> tuple[dict, dict | None]:
    tensors = {t.name: t for t in reader.tensors}
    exact = exact_type(tensors)
    shift = GGUF_ARCHITECTURES[arch].norm_shift
    restore = GGUF_ARCHITECTURES[arch].restore or split_fused_qkv
    weights = {}
    for gguf_name, t in tensors.items():
        hf = hf_name(gguf_name, arch)
        for name, data in restore(hf, unpermute_rows(t.data, hf, config, arch), config).items():
            kind = t.tensor_type.name
            if kind == exact and data.ndim in (2, 3):  # matrices and stacked experts
                base = name.removesuffix(".weight")
                weights[name], weights[f"{base}.scales"], weights[f"{base}.biases"] = to_mlx_quantized(kind, data)
                continue
            weights[name] = decode_float(t, data)
            if shift and name.endswith("norm.weight"):  # Gemma, Nemotron scale by (1 + w); llama.cpp stores 1 + w
                weights[name] = weights[name] - shift
    quantization = {"group_size": GROUP_SIZE, "bits": EXACT_TYPES[exact]} if exact else None
    return weights, quantization


def sentencepiece_tokenizer(meta: dict) -> dict[str, bytes]:
    """A llama-style GGUF vocabulary (pieces, scores, types) -> tokenizer.model. GGUF token
    types use SentencePiece's own numbering (1 normal ... 6 byte)."""
    tokens = meta["tokenizer.ggml.tokens"]
    proto = sentencepiece_pieces(meta, "BPE")
    spec = proto.trainer_spec
    spec.byte_fallback = 6 in (meta.get("tokenizer.ggml.token_type") or ())
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


# -- byte-level BPE pre-tokenizers ----------------------------------------------------------
# llama.cpp's ``tokenizer.ggml.pre`` names each family's tokenizer.json pre-tokenizer; here it
# becomes that pre-tokenizer again: a list of steps, each a regex (a Split that isolates its
# matches) or DIGITS (every digit apart), then ByteLevel, which splits with GPT-2's own regex
# when no regex step came before it. The regexes are those of the families' tokenizer.json
# files (llama.cpp keeps a rewritten copy of each in llama-vocab.cpp).

DIGITS = "digits"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (  # Qwen 3.5: combining marks stay with their letters
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (  # Mistral's Tekken: words split at case changes, no contractions
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_SPLIT = (  # GPT-4o's o200k (gpt-oss, Llama 4)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# What llama.cpp itself splits with when a file names no known pre-tokenizer.
LLAMA_CPP_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", DIGITS)

GPT2 = ()
DIGITS_THEN_GPT2 = (DIGITS,)
PRE_TOKENIZERS = {
    "default": LLAMA_CPP_DEFAULT,
    # "gpt-2" first: the name an export writes (llama.cpp refuses "gpt2", which some files carry)
    **dict.fromkeys(["gpt-2", "gpt2", "phi-2", "olmo", "exaone4", "mellum", "trillion", "a.x-4.0"], GPT2),
    # SmolLM 1/2, StarCoder 2, Refact, Command-R, Minerva: each digit apart, then GPT-2's split
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "minerva-7b"], DIGITS_THEN_GPT2),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral", "midm-2.0"],
                    (LLAMA3_SPLIT,)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo", "f2llmv2"], (QWEN2_SPLIT,)),
    "qwen35": (QWEN35_SPLIT,),
    "tekken": (TEKKEN_SPLIT,),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2"], (O200K_SPLIT,)),
    "seed-coder": (SEED_CODER_SPLIT,),
    "deepseek-coder": DEEPSEEK_CODER,
}


def byte_level_pre_tokenizer(pre: str, path: Path):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise UserError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    steps = PRE_TOKENIZERS[pre]
    splits = [
        pre_tokenizers.Digits(individual_digits=True) if step == DIGITS else pre_tokenizers.Split(Regex(step), "isolated")
        for step in steps
    ]
    own_regex = all(step == DIGITS for step in steps)  # ByteLevel splits as GPT-2 unless a regex did
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=own_regex)])


def byte_level_bpe_tokenizer(meta: dict, path: Path) -> dict[str, bytes]:
    """A GPT-2-style GGUF vocabulary (byte-level pieces and merges) -> tokenizer.json,
    built with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models

    pre_tokenizer = byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer_json_files(tokenizer, meta, tokens, types, add_bos_default=False)


def tokenizer_files(meta: dict, path: Path) -> dict[str, bytes]:
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":
        return sentencepiece_tokenizer(meta)
    if model == "gpt2":
        return byte_level_bpe_tokenizer(meta, path)
    if model == "gemma4":
        return gemma4_tokenizer(meta)
    if model in ("bert", "t5"):
        return bert_tokenizer(meta) if model == "bert" else unigram_tokenizer(meta)
    raise UserError(f"{path}: GGUF tokenizer model {model!r} is not supported (supported: llama, gpt2, gemma4, bert, t5)")


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
    tensors = {t.name: t for t in reader.tensors}
    config = hf_config(meta, tensors, arch)
    if not GGUF_ARCHITECTURES[arch].own_expert_check:
        check_experts(tensors, config, path)
    weights, quantization = read_tensors(reader, config, arch)
    if GGUF_ARCHITECTURES[arch].metadata_tensors is not None:
        weights.update(GGUF_ARCHITECTURES[arch].metadata_tensors(meta, config))
    kinds = {t.tensor_type.name for t in reader.tensors}
    # float16 whenever blocks are carried over: their float16 scales stay exact
    config["torch_dtype"] = "float32" if kinds == {"F32"} else "bfloat16" if kinds <= {"F32", "BF16"} else "float16"
    return Source(config=config, weights=weights, files=files, quantization=quantization)
