"""llama.cpp's GGUF files of the Gated DeltaNet hybrids (``qwen3next``, ``qwen35``,
``qwen35moe``), read back into the Hugging Face checkpoints of Qwen3-Next, Qwen3.5 and
Qwen3.5-MoE (``families/hybrids.py``).

Each row of ``QWEN_NEXT_ARCHITECTURES`` holds the fields of one ``GGUFArchitecture``
(``gguf_file.py`` builds them). ``restore`` undoes what llama.cpp's converter did to a tensor:

- every RMSNorm weight but the linear attention's gated norm is stored plus 1 (the
  checkpoints' norms scale by 1 + weight; llama.cpp's by the weight);
- ``A_log`` is stored as ``A = -exp(A_log)`` (``ssm_a``), ``dt_bias`` as a ``dt_proj`` bias,
  the depthwise convolution's (channels, 1, kernel) weight squeezed;
- Qwen3-Next's ``in_proj_qkvz`` is stored as ``attn_qkv`` (all q, all k, all v rows) and
  ``attn_gate`` (z): the layout of Qwen3.5's ``in_proj_qkv`` and ``in_proj_z``, read back in
  those names; its ``in_proj_ba`` is kept (``ssm_ba``) and split by the family's loader;
- Qwen3.5's value heads, where there are more value heads than key heads, are stored tiled
  (value head j of key head h at h + j * key_heads) instead of grouped by key head
  (h * per_key + j): the v rows of ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``/``a``,
  ``A_log``, ``dt_bias``, the v channels of the convolution and ``out_proj``'s columns;
- the experts are stacked (experts, out, in), mlx-lm's layout; newer converters fuse each
  layer's gate and up experts (``ffn_gate_up_exps``, gate rows first), split here;
- older Qwen3-Next files keep ``in_proj_qkvz`` whole (``ssm_in``), read in that name;
- newer converters append the multi-token-prediction layers as further blocks
  (``nextn_predict_layers``): not part of the language model, they are left out.

Which kind each layer is comes from its tensors and must agree with the file's
``full_attention_interval`` (llama.cpp runs every interval-th layer as full attention).
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import UserError
from .gguf_hybrids import layer_kinds, layer_pairs

QWEN_NEXT_NAMES = (
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.{kind}", "model.norm.{kind}"),
    ("output.{kind}", "lm_head.{kind}"),
    ("blk.{layer}.ssm_a", "model.layers.{layer}.linear_attn.A_log"),
    ("blk.{layer}.ssm_dt.bias", "model.layers.{layer}.linear_attn.dt_bias"),
) + layer_pairs("model.layers", [
    ("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
    ("attn_qkv", "linear_attn.in_proj_qkv"), ("attn_gate", "linear_attn.in_proj_z"),
    ("ssm_in", "linear_attn.in_proj_qkvz"),  # older qwen3next files: fused per key head, the family splits it
    ("ssm_ba", "linear_attn.in_proj_ba"), ("ssm_beta", "linear_attn.in_proj_b"), ("ssm_alpha", "linear_attn.in_proj_a"),
    ("ssm_conv1d", "linear_attn.conv1d"), ("ssm_norm", "linear_attn.norm"), ("ssm_out", "linear_attn.out_proj"),
    ("ffn_gate_inp", "mlp.gate"), ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"), ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_up_exps", "mlp.switch_mlp.gate_up_proj"),  # fused (experts, 2F, D): split on reading
    ("ffn_gate_exps", "mlp.switch_mlp.gate_proj"), ("ffn_up_exps", "mlp.switch_mlp.up_proj"),
    ("ffn_down_exps", "mlp.switch_mlp.down_proj"),
    ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),  # Qwen3.5's dense MLP
])
DELTANET_OR_ATTENTION = {"linear_attention": "ssm_a", "full_attention": "attn_q.weight"}
# the norms llama.cpp's converter stores plus 1 (every "norm.weight" but the gated one)
SHIFTED_NORM = re.compile(r".*(input_layernorm|post_attention_layernorm|model\.norm|q_norm|k_norm)\.weight")
LAYER_OF = re.compile(r"(?:model\.layers|blk)\.(\d+)\.")


def layer_types_of_file(get, tensors: dict, n_layers: int, arch: str) -> list[str]:
    """Each layer's kind as its tensors tell, checked against ``full_attention_interval``
    (4 where the file has none, as llama.cpp reads it)."""
    interval = int(get("full_attention_interval", 4))
    if interval < 1:
        raise UserError(f"GGUF {arch} full_attention_interval is {interval}: it must be 1 or more")
    kinds = layer_kinds(tensors, n_layers, DELTANET_OR_ATTENTION, arch)
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if kinds != expected:
        layer = next(i for i, (k, e) in enumerate(zip(kinds, expected)) if k != e)
        raise UserError(f"GGUF {arch} layer pattern is unknown: layer {layer} holds {kinds[layer]} tensors, "
                        f"full_attention_interval {interval} makes it {expected[layer]}")
    return kinds


def attention_keys(get) -> dict:
    """The full-attention layers' widths and the blocks' norms. A mixture's file may lack
    feed_forward_length (the converter writes it only where the config has a dense width)."""
    n_heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or 0) or None,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length") or hidden // n_heads),
        "max_position_embeddings": int(get("context_length", 262144)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000000.0)),
        "hidden_act": "silu",
    }


def deltanet_keys(get, tensors: dict, arch: str) -> dict:
    """What the three files share: the attention's keys, the ssm.* widths of the linear
    attention (state size = key head width, group count = key heads, time-step rank = value
    heads), the rotated part of each attention head, the blocks less the appended
    prediction layers."""
    keys = attention_keys(get)
    n_layers = int(get("block_count")) - int(get("nextn_predict_layers") or 0)
    n_value_heads = int(get("ssm.time_step_rank"))
    return {
        **keys,
        "num_hidden_layers": n_layers,
        "layer_types": layer_types_of_file(get, tensors, n_layers, arch),
        "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
        "linear_key_head_dim": int(get("ssm.state_size")),
        "linear_num_key_heads": int(get("ssm.group_count")),
        "linear_num_value_heads": n_value_heads,
        "linear_value_head_dim": int(get("ssm.inner_size")) // n_value_heads,
        "partial_rotary_factor": int(get("rope.dimension_count", keys["head_dim"])) / keys["head_dim"],
    }


def expert_keys(get) -> dict:
    """The mixtures: routed experts beside a gated shared expert, the chosen experts'
    weights renormalised (llama.cpp's qwen3next and qwen35moe always do)."""
    return {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length") or 0),
        "norm_topk_prob": True,
    }


def qwen3next_keys(get, base: dict, tensors: dict) -> dict:
    return {**deltanet_keys(get, tensors, "qwen3next"), **expert_keys(get)}


def qwen35_keys(get, base: dict, tensors: dict) -> dict:
    keys = deltanet_keys(get, tensors, "qwen35")
    check_tiled_columns(tensors, keys, "qwen35")
    return keys


def qwen35moe_keys(get, base: dict, tensors: dict) -> dict:
    keys = deltanet_keys(get, tensors, "qwen35moe")
    check_tiled_columns(tensors, keys, "qwen35moe")
    return {**keys, **expert_keys(get)}


def check_tiled_columns(tensors: dict, keys: dict, arch: str) -> None:
    """Each key head serves a whole number of value heads; ``out_proj``'s columns are put
    back in order a value head at a time, which in a quantized tensor moves whole blocks,
    so each value head must fill whole blocks."""
    import gguf

    n_key, n_value = keys["linear_num_key_heads"], keys["linear_num_value_heads"]
    if n_key < 1 or n_value % n_key:
        raise UserError(f"GGUF {arch} has {n_value} value heads (ssm.time_step_rank) for {n_key} key heads "
                        f"(ssm.group_count): not a whole number per key head")
    if n_key == n_value:
        return
    width = keys["linear_value_head_dim"]
    for name in (n for n in tensors if n.endswith("ssm_out.weight")):
        kind = tensors[name].tensor_type
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if width % block:
            raise UserError(f"GGUF {arch} tensor {name} ({kind.name}): value heads of {width} weights "
                            f"do not fill whole {block}-weight blocks, so its tiled heads cannot be reordered")


# -- restoring the checkpoint's tensors ---------------------------------------------------------


def grouped_value_heads(data: np.ndarray, axis: int, config: dict) -> np.ndarray:
    """Value heads along ``axis`` from llama.cpp's tiled order back to grouped by key head:
    (per_key, key_heads, width) -> (key_heads, per_key, width), ``width`` the rest of the axis
    per value head (head width, 1, or a head's quantized bytes)."""
    n_key, n_value = config["linear_num_key_heads"], config["linear_num_value_heads"]
    moved = np.moveaxis(data, axis, 0)
    tiled = moved.reshape(n_value // n_key, n_key, moved.shape[0] // n_value, *moved.shape[1:])
    grouped = np.ascontiguousarray(tiled.swapaxes(0, 1)).reshape(moved.shape)  # (value heads * width, ...)
    return np.moveaxis(grouped, 0, axis)


def grouped_value_rows(data: np.ndarray, config: dict, first: int = 0) -> np.ndarray:
    """Rows ``first:`` (the v rows after q and k, or all of them) put back grouped."""
    return np.concatenate([data[:first], grouped_value_heads(data[first:], 0, config)])


def ungrouped(name: str, data: np.ndarray, config: dict) -> np.ndarray:
    """Undo Qwen3.5's tiling of the value heads on the tensors that hold them."""
    qk_rows = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return grouped_value_rows(data, config, qk_rows)
    if name.endswith(("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", ".A_log", ".dt_bias")):
        return grouped_value_rows(data, config)
    if name.endswith("out_proj.weight"):
        return grouped_value_heads(data, -1, config)  # columns (or a row's quantized bytes)
    return data


def split_gate_up(name: str, data: np.ndarray) -> dict[str, np.ndarray]:
    """Fused experts (experts, 2F, D), gate rows first (raw quantized rows split alike) ->
    the stacked gate and up projections."""
    gate, up = np.split(data, 2, axis=1)  # each (experts, F, D)
    return {name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up}


def without_norm_shift(name: str, data: np.ndarray) -> np.ndarray:
    if not np.issubdtype(data.dtype, np.floating):
        raise UserError(f"GGUF norm {name} is not stored as float (llama.cpp keeps norms in F32)")
    return data.astype(np.float32) - 1.0


def restore_qwen_next(name: str, data: np.ndarray, config: dict) -> dict[str, np.ndarray]:
    """One llama.cpp tensor -> the checkpoint's (see the module's docstring); the appended
    prediction layers' tensors -> none."""
    layer = LAYER_OF.match(name)
    if layer and int(layer.group(1)) >= config["num_hidden_layers"]:
        return {}
    tiled = config["model_type"] != "qwen3_next" and config["linear_num_value_heads"] != config["linear_num_key_heads"]
    if tiled and ".linear_attn." in name:
        data = ungrouped(name, data, config)
    if name.endswith(".switch_mlp.gate_up_proj.weight"):
        return split_gate_up(name, data)
    if name.endswith(".A_log"):
        data = np.log(-np.asarray(data, dtype=np.float32))
    elif name.endswith("conv1d.weight") and data.ndim == 2:
        data = data[:, None, :]  # (channels, 1, kernel)
    elif SHIFTED_NORM.fullmatch(name):
        data = without_norm_shift(name, data)
    return {name: data}


def deltanet_hybrid(model_type: str, hf_architecture: str, config) -> dict:
    return dict(model_type=model_type, hf_architecture=hf_architecture, names=QWEN_NEXT_NAMES, config=config,
                restore=restore_qwen_next, standalone=True)


# llama.cpp architecture -> GGUFArchitecture fields; each config reader builds the whole
# Hugging Face config (standalone).
QWEN_NEXT_ARCHITECTURES = {
    "qwen3next": deltanet_hybrid("qwen3_next", "Qwen3NextForCausalLM", qwen3next_keys),
    "qwen35": deltanet_hybrid("qwen3_5_text", "Qwen3_5ForCausalLM", qwen35_keys),
    "qwen35moe": deltanet_hybrid("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", qwen35moe_keys),
}
