"""llama.cpp's GGUF files of more families, under llama.cpp's architecture names: gptneox,
cohere2, command-r, llama4, gemma4, apertus, seed_oss, exaone4, stablelm, read back into
their Hugging Face checkpoints; and Gemma 4's vocabulary (tokenizer model ``gemma4``).

Each row of ``FAMILY_ARCHITECTURES`` holds the fields of one ``GGUFArchitecture``
(``gguf_file.py`` builds them): the tensor-name table, the family's config keys on top of
the llama-shaped ones every such file has, and ``restore``, which undoes what llama.cpp's
converter did to a tensor:

- GPT-NeoX's fused ``query_key_value`` rows, grouped per head in the checkpoint, are
  written regrouped (all queries, all keys, all values): split by rows as any fused qkv
  (``gguf_file.split_fused_qkv``, the default restore);
- Llama 4's fused experts are written split and transposed into the stacked (experts,
  out, in) layout, the one the family's loader stacks experts into; llama3 RoPE scaling
  (Llama 4, Apertus, EXAONE 4) becomes a ``rope_freqs`` tensor of per-frequency factors,
  from which the scaling's parameters are solved back (``llama3_rope_from_factors``);
- Gemma 4's "proportional" RoPE is a ``rope_freqs`` tensor too (1 for the rotated pairs),
  its ``layer_scalar`` and experts gain a ``.weight``, its head sizes, KV heads and
  feed-forward widths are written per layer kind or per layer;
- Apertus's xIELU parameters become per-layer metadata arrays (``xielu.*``), read back
  into tensors (``GGUFArchitecture.metadata_tensors``);
- what a file cannot say, llama.cpp fixes in its runtime, so it is fixed here alike:
  Cohere 2's every 4th layer global, Llama 4's chunks of 8192 positions, every 4th layer
  unrotated and its temperature tuning (floor 8192, scale 0.1).
"""

from __future__ import annotations

import json
import math

import numpy as np

from ..errors import UserError

NamePair = tuple[str, str]  # (llama.cpp template, Hugging Face template), as gguf_file.py's


def layer_pairs(pairs: list[tuple[str, str]]) -> tuple[NamePair, ...]:
    """``blk.N.{gguf}.weight|bias`` <-> ``model.layers.N.{hf}.weight|bias`` for each pair."""
    return tuple((f"blk.{{layer}}.{g}.{{kind}}", f"model.layers.{{layer}}.{h}.{{kind}}") for g, h in pairs)


HEAD = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.{kind}", "model.norm.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
)
ATTENTION = [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
             ("attn_output", "self_attn.o_proj")]
GATED_MLP = [("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]


# -- GPT-NeoX (Pythia): LayerNorms with biases, a fused qkv, an ungated MLP --------------------

GPTNEOX_NAMES = HEAD + layer_pairs([
    ("attn_norm", "input_layernorm"), ("attn_qkv", "self_attn.qkv_proj"), ("attn_output", "self_attn.o_proj"),
    ("ffn_norm", "post_attention_layernorm"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
])


def gptneox_keys(get, base: dict, tensors: dict) -> dict:
    """GPTNeoXModel writes no KV heads (there are as many as query heads), no RoPE base
    (llama.cpp's default 10000), the rotated dims of a head and the residual's kind."""
    return {
        "num_key_value_heads": base["num_attention_heads"],
        "rotary_pct": int(get("rope.dimension_count", base["head_dim"])) / base["head_dim"],
        "use_parallel_residual": bool(get("use_parallel_residual", True)),
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
        "hidden_act": "gelu",
    }


# -- Cohere 2 (Command R7B): sliding layers that rotate, every pattern-th one global -----------

COHERE2_NAMES = HEAD + layer_pairs([("attn_norm", "input_layernorm"), *ATTENTION, *GATED_MLP])


def sliding_pattern(get, n_layers: int, default_period: int) -> list[bool]:
    """Which layers slide: ``attention.sliding_window_pattern`` as a list per layer or a
    period (every period-th layer global), else llama.cpp's default period."""
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return [bool(s) for s in pattern]
    period = int(pattern or default_period)
    return [(i + 1) % period != 0 for i in range(n_layers)]


def cohere2_keys(get, base: dict, tensors: dict) -> dict:
    """Cohere2Model writes the window and the logit scale; llama.cpp makes every 4th layer
    global unless the file says otherwise."""
    sliding = sliding_pattern(get, base["num_hidden_layers"], 4)
    return {
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "logit_scale": float(get("logit_scale")),
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
    }


# Command R (cohere): Cohere's parallel block; the larger models' q/k LayerNorms per head are
# read, and the family then names them as not supported
COMMAND_R_NAMES = COHERE2_NAMES + layer_pairs([("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")])


def command_r_keys(get, base: dict, tensors: dict) -> dict:
    return {
        "logit_scale": float(get("logit_scale") or 1.0),
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
    }


# -- Llama 4: chunked attention, experts on every step-th layer beside a shared expert ---------

LLAMA4_NAMES = HEAD + (("rope_freqs.weight", "rope_freqs.weight"),) + layer_pairs([
    ("attn_norm", "input_layernorm"), *ATTENTION, ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate_inp", "feed_forward.router"),
    ("ffn_gate_exps", "feed_forward.experts.gate_proj"), ("ffn_up_exps", "feed_forward.experts.up_proj"),
    ("ffn_down_exps", "feed_forward.experts.down_proj"),
    ("ffn_gate_shexp", "feed_forward.shared_expert.gate_proj"), ("ffn_up_shexp", "feed_forward.shared_expert.up_proj"),
    ("ffn_down_shexp", "feed_forward.shared_expert.down_proj"),
    ("ffn_gate", "feed_forward.gate_proj"), ("ffn_up", "feed_forward.up_proj"), ("ffn_down", "feed_forward.down_proj"),
])
# llama.cpp's llama4 runtime: fixed, no file says otherwise
LLAMA4_CHUNK, LLAMA4_NO_ROPE_STEP, LLAMA4_FLOOR_SCALE, LLAMA4_ATTN_SCALE = 8192, 4, 8192, 0.1


def llama4_keys(get, base: dict, tensors: dict) -> dict:
    """Llama4Model writes the dense MLP's width as feed_forward_length, the experts' as
    expert_feed_forward_length; a sliding window of 0 (MobileLLM) turns chunks, the
    temperature tuning and the unrotated layers off (llama.cpp then leaves only the last
    layer unrotated). The 128-expert model normalises no q, k."""
    n_layers = base["num_hidden_layers"]
    n_experts = int(get("expert_count"))
    chunked = get("attention.sliding_window") != 0
    no_rope_step = LLAMA4_NO_ROPE_STEP if chunked else n_layers
    chunk_layers = sliding_pattern(get, n_layers, 4) if chunked else [False] * n_layers
    keys = {
        "intermediate_size": int(get("expert_feed_forward_length")),
        "intermediate_size_mlp": base["intermediate_size"],
        "num_local_experts": n_experts,
        "num_experts_per_tok": int(get("expert_used_count")),
        "interleave_moe_layer_step": int(get("interleave_moe_layer_step")),
        "no_rope_layers": [int((i + 1) % no_rope_step != 0) for i in range(n_layers)],
        "attention_chunk_size": LLAMA4_CHUNK if chunked else None,
        "layer_types": ["chunked_attention" if c else "full_attention" for c in chunk_layers],
        "attn_temperature_tuning": chunked,
        "floor_scale": LLAMA4_FLOOR_SCALE,
        "attn_scale": LLAMA4_ATTN_SCALE,
        "use_qk_norm": n_experts != 128,
        "hidden_act": "silu",
    }
    return {**keys, **llama3_scaling_keys(base, tensors)}


def llama3_scaling_keys(base: dict, tensors: dict) -> dict:
    """LlamaModel's converters (Llama 4, Apertus) write llama3 RoPE scaling as rope_freqs."""
    if "rope_freqs.weight" not in tensors:
        return {}
    factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
    return {"rope_scaling": llama3_rope_from_factors(factors, base["rope_theta"], base["head_dim"])}


def drop_rope_freqs(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """llama.cpp's RoPE factors are in the config now (llama4_keys, gemma4_keys): no
    tensor of the model."""
    return {} if name == "rope_freqs.weight" else {name: data}


def restore_gemma4(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """The RoPE factors dropped (gemma4_keys read them); layer_scalar and the experts
    without the .weight the converter gave them."""
    if name.endswith((".layer_scalar.weight", ".experts.gate_up_proj.weight", ".experts.down_proj.weight")):
        return {name.removesuffix(".weight"): data}
    return drop_rope_freqs(name, data, config)


# The original context the solved llama3 parameters are given in: any value gives the same
# factors (only its ratios to the frequency factors count).
LLAMA3_CONTEXT = 8192


def llama3_rope_from_factors(factors: np.ndarray, base: float, head_dim: int) -> dict | None:
    """Llama 3's RoPE scaling from llama.cpp's ``rope_freqs`` (one factor per rotated pair,
    each frequency divided by its factor): 1 above the high-frequency bound, the scaling
    factor below the low one, between them 1 / ((1 - s) / factor + s) with s linear in the
    inverse wavelength x = freq / 2pi, s = (context x - low) / (high - low). The bounds
    solved here give back the same factors; None when every factor is 1."""
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    x = base ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)  # (head_dim / 2,)
    if len(factors) != len(x):
        raise UserError(f"GGUF rope_freqs holds {len(factors)} factors, expected {len(x)} (half the head)")
    s = (1 / factors - 1 / factor) / (1 - 1 / factor)
    between = (s > 1e-6) & (s < 1 - 1e-6)
    x_low, x_high = llama3_bounds(x, s, between)
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": x_low * LLAMA3_CONTEXT,
            "high_freq_factor": x_high * LLAMA3_CONTEXT, "original_max_position_embeddings": LLAMA3_CONTEXT}


def llama3_bounds(x: np.ndarray, s: np.ndarray, between: np.ndarray) -> tuple[float, float]:
    """The inverse wavelengths where s is 0 and 1: the line through the smoothed factors,
    or, with fewer than two of them, bounds in the gaps around the unsmoothed ones."""
    if between.sum() >= 2:
        slope, intercept = np.polyfit(x[between], s[between], 1)  # s = slope x + intercept
        return float(-intercept / slope), float((1 - intercept) / slope)
    scaled_x = x[~between & (s < 0.5)]  # divided by the whole factor
    plain_x = x[~between & (s >= 0.5)]
    lowest = float(scaled_x.max()) if len(scaled_x) else 0.0
    highest = float(plain_x.min()) if len(plain_x) else float(x.max()) * 2
    if not between.any():
        return lowest, highest
    x_s, s_s = float(x[between][0]), float(s[between][0])
    width = min((x_s - lowest) / s_s, (highest - x_s) / (1 - s_s))
    return x_s - s_s * width, x_s - s_s * width + width


# -- Gemma 4: per-layer inputs, KV sharing, full layers with their own head size -----------------

GEMMA4_NAMES = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("rope_freqs.weight", "rope_freqs.weight"),
    ("per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"),
    ("per_layer_model_proj.weight", "model.per_layer_model_projection.weight"),
    ("per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight"),
    # the converter adds the .weight the checkpoint's layer_scalar lacks (restore_gemma4 drops it)
    ("blk.{layer}.layer_output_scale.weight", "model.layers.{layer}.layer_scalar.weight"),
    # the experts beside the dense FFN: gate and up fused (experts, 2F, D), as the checkpoint's
    # (the .weight restore_gemma4 drops again), the router's scales under llama.cpp's names
    ("blk.{layer}.ffn_gate_up_exps.weight", "model.layers.{layer}.experts.gate_up_proj.weight"),
    ("blk.{layer}.ffn_down_exps.weight", "model.layers.{layer}.experts.down_proj.weight"),
    ("blk.{layer}.ffn_gate_inp.weight", "model.layers.{layer}.router.proj.weight"),
    ("blk.{layer}.ffn_gate_inp.scale", "model.layers.{layer}.router.scale"),
    ("blk.{layer}.ffn_down_exps.scale", "model.layers.{layer}.router.per_expert_scale"),
) + layer_pairs([
    ("pre_ffw_norm_2", "pre_feedforward_layernorm_2"), ("post_ffw_norm_1", "post_feedforward_layernorm_1"),
    ("post_ffw_norm_2", "post_feedforward_layernorm_2"),
    *ATTENTION, ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"), *GATED_MLP,
    ("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
    ("inp_gate", "per_layer_input_gate"), ("proj", "per_layer_projection"), ("post_norm", "post_per_layer_input_norm"),
])


def per_layer_values(value, n_layers: int) -> list:
    """A key written once or once per layer, as a list per layer."""
    return list(value) if isinstance(value, list) else [value] * n_layers


def gemma4_keys(get, base: dict, tensors: dict) -> dict:
    """Gemma4Model writes the full layers' head size as key_length and the sliding ones'
    as key_length_swa, the KV heads (and, with use_double_wide_mlp, the feed-forward width)
    per layer, which layers slide as a list; keys serve as values where a full layer has
    no attn_v. Its norms are stored as they are (no 1 + w)."""
    n_layers = base["num_hidden_layers"]
    sliding = sliding_pattern(get, n_layers, 6)
    kv_heads = per_layer_values(get("attention.head_count_kv"), n_layers)
    widths = per_layer_values(get("feed_forward_length"), n_layers)
    n_shared = int(get("attention.shared_kv_layers") or 0)
    full = [i for i in range(n_layers - n_shared) if not sliding[i]]
    k_eq_v = any(f"blk.{i}.attn_v.weight" not in tensors for i in full)
    global_head_dim = int(get("attention.key_length"))
    return {
        "head_dim": int(get("attention.key_length_swa")),
        "global_head_dim": global_head_dim,
        "num_key_value_heads": int(next(h for h, s in zip(kv_heads, sliding) if s) if any(sliding) else kv_heads[0]),
        "num_global_key_value_heads": int(kv_heads[full[0]]) if full and k_eq_v else None,
        "attention_k_eq_v": k_eq_v,
        "intermediate_size": int(min(widths)),
        "use_double_wide_mlp": len(set(widths)) > 1,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "final_logit_softcapping": get("final_logit_softcapping"),
        "num_kv_shared_layers": n_shared,
        "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input") or 0),
        "vocab_size_per_layer_input": int(tensors["per_layer_token_embd.weight"].shape[1])
        if "per_layer_token_embd.weight" in tensors else base["vocab_size"],
        "rope_parameters": gemma4_rope_parameters(get, tensors, global_head_dim),
        **gemma4_expert_keys(get),
    }


def gemma4_expert_keys(get) -> dict:
    """The routed experts beside every dense FFN, when the file has them."""
    if not get("expert_count"):
        return {}
    return {"enable_moe_block": True, "num_experts": int(get("expert_count")),
            "top_k_experts": int(get("expert_used_count")), "moe_intermediate_size": int(get("expert_feed_forward_length"))}


def gemma4_rope_parameters(get, tensors: dict, global_head_dim: int) -> dict:
    """The full layers rotate "proportionally": llama.cpp's rope_freqs holds factor 1 for
    the rotated pairs and 1e30 (no rotation) for the rest of the head."""
    full = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1_000_000.0))}
    if "rope_freqs.weight" in tensors:
        rotated = int((np.asarray(tensors["rope_freqs.weight"].data) == 1.0).sum())
        full.update(rope_type="proportional", partial_rotary_factor=2 * rotated / global_head_dim)
    sliding = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10_000.0))}
    return {"sliding_attention": sliding, "full_attention": full}




# -- Apertus: q/k norms, an ungated MLP with the learned xIELU activation ----------------------

APERTUS_NAMES = HEAD + (("rope_freqs.weight", "rope_freqs.weight"),) + layer_pairs([
    ("attn_norm", "attention_layernorm"), *ATTENTION, ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"), ("ffn_norm", "feedforward_layernorm"), ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
])
XIELU_PARAMETERS = ("alpha_p", "alpha_n", "beta", "eps")


def apertus_keys(get, base: dict, tensors: dict) -> dict:
    """ApertusModel is a LlamaModel that keeps q/k rows as they are (Apertus rotates halves,
    as llama.cpp's apertus) and writes llama3 RoPE scaling as rope_freqs."""
    return {"hidden_act": "xielu", "mlp_bias": "blk.0.ffn_up.bias" in tensors, **llama3_scaling_keys(base, tensors)}


def apertus_xielu(meta: dict, config: dict) -> dict:
    """ApertusModel writes each layer's xIELU parameters as metadata lists ``xielu.*``,
    the raw parameters (before softplus) as the checkpoint holds them: the tensors again,
    alpha_p / alpha_n (1,) and beta / eps scalars."""
    import mlx.core as mx

    weights = {}
    for parameter in XIELU_PARAMETERS:
        values = meta.get(f"xielu.{parameter}")
        if not isinstance(values, list) or len(values) != config["num_hidden_layers"]:
            raise UserError(f"GGUF apertus metadata lacks xielu.{parameter} (one value per layer)")
        for layer, value in enumerate(values):
            shape = (1,) if parameter.startswith("alpha") else ()
            weights[f"model.layers.{layer}.mlp.act_fn.{parameter}"] = mx.full(shape, float(value), mx.float32)
    return weights


# -- Seed-OSS (biases as the tensors say) and EXAONE 4 (norms after each sublayer, LLLG windows)

# llama.cpp names Seed-OSS's norm before the MLP (post_attention_layernorm) post_attention_norm
SEED_OSS_NAMES = HEAD + layer_pairs([*ATTENTION, ("attn_norm", "input_layernorm"),
                                     ("post_attention_norm", "post_attention_layernorm"), *GATED_MLP])


def seed_oss_keys(get, base: dict, tensors: dict) -> dict:
    return {"attention_bias": "blk.0.attn_q.bias" in tensors, "attention_out_bias": "blk.0.attn_output.bias" in tensors}


EXAONE4_NAMES = HEAD + (("rope_freqs.weight", "rope_freqs.weight"),) + layer_pairs([
    *ATTENTION, ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"), *GATED_MLP,
    ("post_attention_norm", "post_attention_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
])


def exaone4_keys(get, base: dict, tensors: dict) -> dict:
    """Exaone4Model writes which layers slide as a list (only with a window); llama3 RoPE
    scaling as rope_freqs."""
    window = get("attention.sliding_window")
    keys = {"sliding_window": int(window) if window else None, **llama3_scaling_keys(base, tensors)}
    if window:
        sliding = sliding_pattern(get, base["num_hidden_layers"], 4)
        keys["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return keys


# -- StableLM: LayerNorms with biases, partial RoPE, optional qkv biases and parallel block

STABLELM_NAMES = HEAD + layer_pairs([*ATTENTION, ("attn_norm", "input_layernorm"),
                                     ("ffn_norm", "post_attention_layernorm"), *GATED_MLP])

def stablelm_keys(get, base: dict, tensors: dict) -> dict:
    """StableLMModel writes no RoPE base (llama.cpp's 10000) and the residual's kind."""
    return {
        "partial_rotary_factor": int(get("rope.dimension_count", base["head_dim"])) / base["head_dim"],
        "layer_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5)),
        "use_qkv_bias": "blk.0.attn_q.bias" in tensors,
        "use_parallel_residual": bool(get("use_parallel_residual", False)),
    }


def family(model_type: str, hf_architecture: str, names, config, restore=None, **more) -> dict:
    return dict(model_type=model_type, hf_architecture=hf_architecture, names=names, config=config, restore=restore,
                **more)


FAMILY_ARCHITECTURES = {
    "gptneox": family("gpt_neox", "GPTNeoXForCausalLM", GPTNEOX_NAMES, gptneox_keys),
    "cohere2": family("cohere2", "Cohere2ForCausalLM", COHERE2_NAMES, cohere2_keys),
    "command-r": family("cohere", "CohereForCausalLM", COMMAND_R_NAMES, command_r_keys),
    "llama4": family("llama4_text", "Llama4ForCausalLM", LLAMA4_NAMES, llama4_keys, drop_rope_freqs),
    "apertus": family("apertus", "ApertusForCausalLM", APERTUS_NAMES, apertus_keys, drop_rope_freqs,
                      metadata_tensors=apertus_xielu),
    "seed_oss": family("seed_oss", "SeedOssForCausalLM", SEED_OSS_NAMES, seed_oss_keys),
    "exaone4": family("exaone4", "Exaone4ForCausalLM", EXAONE4_NAMES, exaone4_keys, drop_rope_freqs),
    "stablelm": family("stablelm", "StableLmForCausalLM", STABLELM_NAMES, stablelm_keys),
    "gemma4": family("gemma4_text", "Gemma4ForCausalLM", GEMMA4_NAMES, gemma4_keys, restore_gemma4),
}


def gemma4_tokenizer(meta: dict) -> dict[str, bytes]:
    """Gemma 4's vocabulary (tokenizer model ``gemma4``: SentencePiece-style BPE, merges over
    raw UTF-8 with spaces as "▁", bytes as <0xNN> pieces) -> tokenizer.json, split as
    llama.cpp splits it: at runs of newlines only."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab={piece: i for i, piece in enumerate(tokens)}, merges=merges, byte_fallback=True,
                     fuse_unk=True, unk_token=tokens[int(unk_id)] if unk_id is not None else None)
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), "isolated")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer_json_files(tokenizer, meta, tokens, types, add_bos_default=True)


def tokenizer_json_files(tokenizer, meta: dict, tokens: list[str], types: list[int],
                         add_bos_default: bool) -> dict[str, bytes]:
    """A GGUF vocabulary's ``tokenizers`` model finished as a folder's files: its control and
    user-defined tokens added, BOS prepended where the file says, tokenizer.json and a
    tokenizer_config.json (shared by the byte-level BPE and Gemma 4 readers)."""
    from tokenizers import AddedToken, processors

    # control tokens (type 3) are special; user-defined ones (type 4) are matched whole
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i, k in enumerate(types) if k == 3])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, k in enumerate(types) if k == 4])
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None
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
