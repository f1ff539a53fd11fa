"""llama.cpp's GGUF files of the hybrid families: short convolutions (lfm2, lfm2moe) and
state-space models (mamba2, mamba; beside attention: granitehybrid, falcon-h1, nemotron_h), read back
into their Hugging Face checkpoints.

Each row of ``HYBRID_ARCHITECTURES`` holds the fields of one ``GGUFArchitecture``
(``gguf_file.py`` builds them): the tensor-name table, a config reader that builds the
whole Hugging Face config (these files carry no llama-shaped attention metadata), and
``restore``, which undoes what llama.cpp's converter did to a tensor:

- the depthwise convolutions' weights (channels, 1, kernel) are stored squeezed;
- Mamba's ``A_log`` is stored as ``A = -exp(A_log)`` (``ssm_a``), Mamba-2's A and D with a
  trailing axis of 1, its gated norm's weight grouped (groups, inner / groups);
- Mamba-2's ``dt_bias`` is named as a ``dt_proj`` bias (``ssm_dt.bias``);
- Granite 4's fused expert and shared-MLP ``input_linear`` are split into gate and up (read
  back in the split names the families' loaders take), and its and Nemotron-H's attention
  q/k rows permuted as a Llama's (``permuted_qk``), though neither rotates;
- Falcon-H1's muP multipliers are folded into its weights, so its config sets them all to 1.

Which kind each layer is comes from its tensors (a layer with ``shortconv.in_proj`` is a
convolution); a layer that holds none of the kinds the family knows is an error naming it.
"""

from __future__ import annotations

import numpy as np

from ..errors import UserError
from .llama2c import interleaved_to_half_split

NamePair = tuple[str, str]  # (llama.cpp template, Hugging Face template), as gguf_file.py's


def layer_pairs(prefix: str, pairs: list[tuple[str, str]]) -> tuple[NamePair, ...]:
    """``blk.N.{gguf}.weight|bias`` <-> ``{prefix}.N.{hf}.weight|bias`` for each pair."""
    return tuple((f"blk.{{layer}}.{g}.{{kind}}", f"{prefix}.{{layer}}.{h}.{{kind}}") for g, h in pairs)


def layer_kinds(tensors: dict, n_layers: int, markers: dict[str, str], arch: str) -> list[str]:
    """Each layer's kind: the first of ``markers`` (kind -> llama.cpp tensor of that kind,
    ``blk.N.`` left off) the layer holds; an error naming a layer that holds none."""
    kinds = []
    for layer in range(n_layers):
        found = [kind for kind, part in markers.items() if f"blk.{layer}.{part}" in tensors]
        if not found:
            held = sorted(name.split(".", 2)[2] for name in tensors if name.startswith(f"blk.{layer}."))
            raise UserError(f"GGUF {arch} layer {layer} is of no known kind: it holds {', '.join(held) or 'no tensors'}"
                            f" (known: {', '.join(f'{k} ({p})' for k, p in markers.items())})")
        kinds.append(found[0])
    return kinds


def tensor_rows(tensors: dict, name: str) -> int:
    """A tensor's leading axis as numpy reads it (rows of a matrix, length of a vector)."""
    return int(tensors[name].data.shape[0])


# -- LFM2 and LFM2-MoE: short convolutions beside attention -----------------------------------

LFM2_NAMES = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("token_embd_norm.weight", "model.embedding_norm.weight"),
    ("output.weight", "lm_head.weight"),
) + layer_pairs("model.layers", [
    ("shortconv.conv", "conv.conv"), ("shortconv.in_proj", "conv.in_proj"), ("shortconv.out_proj", "conv.out_proj"),
    ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.out_proj"), ("attn_q_norm", "self_attn.q_layernorm"),
    ("attn_k_norm", "self_attn.k_layernorm"), ("attn_norm", "operator_norm"), ("ffn_norm", "ffn_norm"),
    ("ffn_gate", "feed_forward.w1"), ("ffn_up", "feed_forward.w3"), ("ffn_down", "feed_forward.w2"),
    ("ffn_gate_inp", "feed_forward.gate"),
]) + (
    # stacked experts (experts, out, in): the layout the family's loader stacks experts into
    ("blk.{layer}.ffn_gate_exps.weight", "model.layers.{layer}.feed_forward.switch_mlp.gate_proj.weight"),
    ("blk.{layer}.ffn_up_exps.weight", "model.layers.{layer}.feed_forward.switch_mlp.up_proj.weight"),
    ("blk.{layer}.ffn_down_exps.weight", "model.layers.{layer}.feed_forward.switch_mlp.down_proj.weight"),
    # the router's bias, in our name: Hugging Face's (feed_forward.expert_bias) has no
    # .bias suffix, which llama.cpp's converter adds
    ("blk.{layer}.exp_probs_b.bias", "model.layers.{layer}.mlp.e_score_correction_bias"),
)
LFM2_KINDS = {"conv": "shortconv.in_proj.weight", "full_attention": "attn_q.weight"}


def lfm2_keys(get, base: dict, tensors: dict) -> dict:
    """LFM2Model writes head_count_kv per layer (0 on conv layers) and the feed-forward
    width already derived (so no further adjusting)."""
    n_layers = int(get("block_count"))
    kinds = layer_kinds(tensors, n_layers, LFM2_KINDS, "lfm2")
    kv_heads = get("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads]
    first_conv = kinds.index("conv") if "conv" in kinds else None
    return {
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(max(kv_heads)),
        "layer_types": kinds,
        "norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 1000000.0)),
        "max_position_embeddings": int(get("context_length", 128000)),
        "conv_L_cache": int(get("shortconv.l_cache")),
        "conv_bias": first_conv is not None and f"blk.{first_conv}.shortconv.in_proj.bias" in tensors,
    }


def lfm2moe_keys(get, base: dict, tensors: dict) -> dict:
    """LFM2MoeModel: sigmoid routing (the only kind the family has); the dense layers come
    first. llama.cpp scales the chosen weights by expert_weights_scale when a file sets it."""
    if int(get("expert_gating_func") or 2) != 2:
        raise UserError("GGUF lfm2moe with softmax expert gating is not supported (sigmoid only)")
    n_dense = int(get("leading_dense_block_count") or 0)
    return {
        **lfm2_keys(get, base, tensors),
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "num_dense_layers": n_dense,
        "first_k_dense_replace": n_dense,  # where gguf_file's expert check starts
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
    }


def restore_lfm2(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """The convolution's squeezed (channels, kernel) weight -> Hugging Face's (channels, 1, kernel)."""
    if name.endswith("conv.conv.weight") and data.ndim == 2:
        data = data[:, None, :]  # (channels, 1, kernel)
    return {name: data}


# -- Mamba-2 and Mamba: state-space layers -----------------------------------------------------

BACKBONE_NAMES = (
    ("token_embd.weight", "backbone.embeddings.weight"),
    ("output_norm.{kind}", "backbone.norm_f.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
    ("blk.{layer}.ssm_a", "backbone.layers.{layer}.mixer.A_log"),
    ("blk.{layer}.ssm_d", "backbone.layers.{layer}.mixer.D"),
)
MAMBA2_NAMES = BACKBONE_NAMES + (("blk.{layer}.ssm_dt.bias", "backbone.layers.{layer}.mixer.dt_bias"),) + layer_pairs(
    "backbone.layers", [("attn_norm", "norm"), ("ssm_in", "mixer.in_proj"), ("ssm_conv1d", "mixer.conv1d"),
                        ("ssm_norm", "mixer.norm"), ("ssm_out", "mixer.out_proj")])
MAMBA_NAMES = BACKBONE_NAMES + layer_pairs(
    "backbone.layers", [("attn_norm", "norm"), ("ssm_in", "mixer.in_proj"), ("ssm_conv1d", "mixer.conv1d"),
                        ("ssm_x", "mixer.x_proj"), ("ssm_dt", "mixer.dt_proj"), ("ssm_out", "mixer.out_proj")])
MAMBA_KINDS = {"mamba": "ssm_in.weight"}


def ssm_keys(get, tensors: dict, arch: str) -> dict:
    """What Mamba and Mamba-2 files share: the ssm.* widths, biases told by their tensors."""
    n_layers = int(get("block_count"))
    layer_kinds(tensors, n_layers, MAMBA_KINDS, arch)
    return {
        "hidden_size": int(get("embedding_length")),
        "num_hidden_layers": n_layers,
        "state_size": int(get("ssm.state_size")),
        "conv_kernel": int(get("ssm.conv_kernel")),
        "layer_norm_epsilon": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "use_bias": "blk.0.ssm_in.bias" in tensors,
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in tensors,
    }


def mamba2_keys(get, base: dict, tensors: dict) -> dict:
    """Mamba2Model writes the heads as ssm.time_step_rank (one dt per head)."""
    keys = ssm_keys(get, tensors, "mamba2")
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    return {**keys, "num_heads": heads, "head_dim": inner // heads, "expand": inner / keys["hidden_size"],
            "n_groups": int(get("ssm.group_count") or 1)}


def mamba_keys(get, base: dict, tensors: dict) -> dict:
    """MambaModel: ssm.dt_b_c_rms marks Falcon-Mamba (RMS-normed B, C and dt)."""
    keys = ssm_keys(get, tensors, "mamba")
    return {**keys, "intermediate_size": int(get("ssm.inner_size")), "time_step_rank": int(get("ssm.time_step_rank")),
            "use_bcdt_rms": bool(get("ssm.dt_b_c_rms") or False)}


def restore_ssm(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """Undo the converter: A = -exp(A_log) -> A_log; Mamba-2's (heads, 1) A and D and
    grouped norm -> flat; squeezed conv weights -> (channels, 1, kernel)."""
    flat = config["model_type"] != "mamba"  # Mamba-2 mixers
    if name.endswith(".A_log"):
        data = np.log(-np.asarray(data, dtype=np.float32))
        return {name: data.reshape(-1) if flat else data}  # mamba2 (heads,), mamba (inner, state)
    if flat and name.endswith((".D", "mixer.norm.weight", "mamba.norm.weight")):
        return {name: np.asarray(data).reshape(-1)}  # (heads,) / (inner,)
    if name.endswith("conv1d.weight") and data.ndim == 2:
        return {name: data[:, None, :]}  # (channels, 1, kernel)
    return {name: data}


# -- Granite 4 (granitehybrid) and Nemotron-H: Mamba-2 layers beside attention ---------------

MAMBA2_MIXER = [("ssm_in", "in_proj"), ("ssm_conv1d", "conv1d"), ("ssm_norm", "norm"), ("ssm_out", "out_proj")]


def mamba2_mixer_names(prefix: str) -> tuple[NamePair, ...]:
    """A Mamba-2 mixer at ``{prefix}.N.{block}``, ``prefix`` e.g. ``model.layers.{layer}.mamba``."""
    return (
        ("blk.{layer}.ssm_a", f"{prefix}.A_log"), ("blk.{layer}.ssm_d", f"{prefix}.D"),
        ("blk.{layer}.ssm_dt.bias", f"{prefix}.dt_bias"),
    ) + tuple((f"blk.{{layer}}.{g}.{{kind}}", f"{prefix}.{h}.{{kind}}") for g, h in MAMBA2_MIXER)


GRANITE_HYBRID_NAMES = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.{kind}", "model.norm.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
) + mamba2_mixer_names("model.layers.{layer}.mamba") + layer_pairs("model.layers", [
    ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"), ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate_inp", "block_sparse_moe.router.layer"),
    # split as the converter splits input_linear; the names the family loader takes split
    ("ffn_gate_exps", "block_sparse_moe.switch_mlp.gate_proj"), ("ffn_up_exps", "block_sparse_moe.switch_mlp.up_proj"),
    ("ffn_down_exps", "block_sparse_moe.switch_mlp.down_proj"), ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"), ("ffn_down_shexp", "shared_mlp.output_linear"),
    ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),  # no experts
])
ATTENTION_OR_MAMBA = {"mamba": "ssm_in.weight", "attention": "attn_q.weight"}


def per_layer_heads(get, key: str) -> int:
    """The largest of a per-layer list (0 on the layers without attention) or the one value."""
    value = get(key)
    return int(max(value) if isinstance(value, list) else value)


def mamba2_beside_attention_keys(get, tensors: dict, prefix: str) -> dict:
    """The Mamba-2 widths Granite 4 and Nemotron-H files share (``prefix`` Granite's
    ``mamba_`` or Nemotron's none), and the attention heads."""
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": per_layer_heads(get, "attention.head_count_kv"),
        "head_dim": int(get("attention.key_length") or hidden // n_heads),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        f"{prefix}n_groups": int(get("ssm.group_count") or 1),
        "conv_kernel" if not prefix else "mamba_d_conv": int(get("ssm.conv_kernel")),
        "ssm_state_size" if not prefix else "mamba_d_state": int(get("ssm.state_size")),
        "use_conv_bias" if not prefix else "mamba_conv_bias": any(n.endswith("ssm_conv1d.bias") for n in tensors),
    } | ({"mamba_num_heads": heads, "mamba_head_dim": inner // heads} if not prefix else
         {"mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner / hidden})


def granite_hybrid_keys(get, base: dict, tensors: dict) -> dict:
    """GraniteHybridModel: Granite's multipliers (each written only when set), experts
    beside a shared MLP (or that MLP alone), RoPE only where rope.scaling.finetuned says."""
    n_layers = int(get("block_count"))
    kinds = layer_kinds(tensors, n_layers, ATTENTION_OR_MAMBA, "granitehybrid")
    n_experts = int(get("expert_count") or 0)
    shared = get("expert_shared_feed_forward_length")
    if shared is None and not n_experts:  # the dense MLP is the shared one, sized by its rows
        shared = tensor_rows(tensors, "blk.0.ffn_up.weight")
    keys = mamba2_beside_attention_keys(get, tensors, "mamba_")
    return {
        **keys,
        "layer_types": kinds,
        "intermediate_size": int(get("expert_feed_forward_length") or get("feed_forward_length")),
        "shared_intermediate_size": int(shared or 0),
        "num_local_experts": n_experts,
        "num_experts_per_tok": int(get("expert_used_count") or 0),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "attention_multiplier": float(get("attention.scale") or keys["head_dim"] ** -0.5),
        "embedding_multiplier": float(get("embedding_scale") or 1.0),
        "residual_multiplier": float(get("residual_scale") or 1.0),
        "logits_scaling": float(get("logit_scale") or 1.0),
        "position_embedding_type": "rope" if get("rope.scaling.finetuned") else "nope",
        "mamba_proj_bias": "blk.0.ssm_in.bias" in tensors,
    }


NEMOTRON_H_NAMES = (
    ("token_embd.weight", "backbone.embeddings.weight"),
    ("output_norm.{kind}", "backbone.norm_f.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
) + mamba2_mixer_names("backbone.layers.{layer}.mixer") + layer_pairs("backbone.layers", [
    ("attn_q", "mixer.q_proj"), ("attn_k", "mixer.k_proj"), ("attn_v", "mixer.v_proj"),
    ("attn_output", "mixer.o_proj"), ("attn_norm", "norm"), ("ffn_up", "mixer.up_proj"), ("ffn_down", "mixer.down_proj"),
])
# Nemotron-H's own pattern letters: Mamba-2, attention, MLP
NEMOTRON_H_KINDS = {"M": "ssm_in.weight", "*": "attn_q.weight", "-": "ffn_up.weight"}


def nemotron_h_keys(get, base: dict, tensors: dict) -> dict:
    """NemotronHModel: feed_forward_length per layer (0 off the MLP layers), the pattern
    the layers' tensors tell."""
    n_layers = int(get("block_count"))
    kinds = layer_kinds(tensors, n_layers, NEMOTRON_H_KINDS, "nemotron_h")
    eps = get("attention.layer_norm_rms_epsilon") or get("attention.layer_norm_epsilon") or 1e-5
    return {
        **mamba2_beside_attention_keys(get, tensors, ""),
        "hybrid_override_pattern": "".join(kinds),
        "intermediate_size": per_layer_heads(get, "feed_forward_length"),
        "layer_norm_epsilon": float(eps),
        "use_bias": "blk.0.ssm_in.bias" in tensors,
        "mlp_bias": any(n.endswith("ffn_up.bias") for n in tensors),
    }


def restore_nemotron_h(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """As any Mamba-2 mixer's, and the attention's q/k rows permuted back (gguf_file's
    permuted_qk looks for self_attn names; Nemotron-H's are mixer.*)."""
    if name.endswith("mixer.q_proj.weight"):
        return {name: interleaved_to_half_split(data, config["num_attention_heads"])}
    if name.endswith("mixer.k_proj.weight"):
        return {name: interleaved_to_half_split(data, config["num_key_value_heads"])}
    return restore_ssm(name, data, config)


FALCON_H1_NAMES = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.{kind}", "model.final_layernorm.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
    # gguf's TensorNameMap holds the whole name, so the converter writes it without a suffix
    ("blk.{layer}.ffn_norm", "model.layers.{layer}.pre_ff_layernorm.weight"),
) + mamba2_mixer_names("model.layers.{layer}.mamba") + layer_pairs("model.layers", [
    ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"), ("attn_norm", "input_layernorm"), ("ffn_gate", "feed_forward.gate_proj"),
    ("ffn_up", "feed_forward.up_proj"), ("ffn_down", "feed_forward.down_proj"),
])
# FalconH1Model folds every muP multiplier into the weights it writes: read back, none is left.
FALCON_H1_UNIT_MULTIPLIERS = {
    "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0, "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
    "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0],
}


def falcon_h1_keys(get, base: dict, tensors: dict) -> dict:
    """FalconH1Model: attention and a Mamba-2 mixer in every layer (the gated norm only
    when the checkpoint has one), the multipliers already in the weights."""
    n_layers = int(get("block_count"))
    layer_kinds(tensors, n_layers, {"attention and mamba": "ssm_in.weight"}, "falcon-h1")
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length") or hidden // n_heads),
        "max_position_embeddings": int(get("context_length") or 4096),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "mamba_d_ssm": inner, "mamba_n_heads": heads, "mamba_d_head": inner // heads,
        "mamba_d_state": int(get("ssm.state_size")), "mamba_n_groups": int(get("ssm.group_count") or 1),
        "mamba_d_conv": int(get("ssm.conv_kernel")),
        "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in tensors,
        "mamba_proj_bias": "blk.0.ssm_in.bias" in tensors,
        "projectors_bias": "blk.0.ssm_out.bias" in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in tensors,
        **FALCON_H1_UNIT_MULTIPLIERS,
    }


def standalone(model_type: str, hf_architecture: str, names, config, restore) -> dict:
    return dict(model_type=model_type, hf_architecture=hf_architecture, names=names, config=config,
                restore=restore, standalone=True)


HYBRID_ARCHITECTURES = {
    "lfm2": standalone("lfm2", "Lfm2ForCausalLM", LFM2_NAMES, lfm2_keys, restore_lfm2),
    "lfm2moe": standalone("lfm2_moe", "Lfm2MoeForCausalLM", LFM2_NAMES, lfm2moe_keys, restore_lfm2),
    "mamba2": standalone("mamba2", "Mamba2ForCausalLM", MAMBA2_NAMES, mamba2_keys, restore_ssm),
    "mamba": standalone("mamba", "MambaForCausalLM", MAMBA_NAMES, mamba_keys, restore_ssm),
    "granitehybrid": {**standalone("granitemoehybrid", "GraniteMoeHybridForCausalLM", GRANITE_HYBRID_NAMES,
                                   granite_hybrid_keys, restore_ssm), "permuted_qk": True},
    "falcon-h1": standalone("falcon_h1", "FalconH1ForCausalLM", FALCON_H1_NAMES, falcon_h1_keys, restore_ssm),
    "nemotron_h": standalone("nemotron_h", "NemotronHForCausalLM", NEMOTRON_H_NAMES, nemotron_h_keys,
                             restore_nemotron_h),
}
