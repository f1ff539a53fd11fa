"""``ModelArgs``: every variant of the one model as a field of one frozen dataclass.

``ModelArgs.from_dict`` ignores unknown keys and derives what the config leaves out
(``num_key_value_heads``, ``head_dim``, ``attention_scale``, ``layer_types``), so a
family's table entry only says what differs (``mlx_tfm.families``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 0  # 0: derived by from_dict (= num_attention_heads, MHA)
    head_dim: int = 0  # 0: derived by from_dict (= hidden_size // num_attention_heads)
    intermediate_size: int = 11008
    # normalisation
    norm_type: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only
    norm_weight_offset: float = 0.0  # Gemma (RMSNorm), Nemotron (LayerNorm) scale by (1 + weight)
    # "pre" | "post" (original Transformer) | "sandwich" (Gemma 2: each sublayer's input and
    # output) | "post_sublayer" (OLMo 2: only each sublayer's output) | "parallel" (Phi-2,
    # Cohere: attention and MLP both read one norm of x and both add to x) | "parallel_two_norms"
    # (GPT-NeoX: the same with a norm for each)
    norm_placement: str = "pre"
    residual: bool = True  # False drops the skip connections (a gradient-flow ablation)
    residual_scale: float = 1.0  # Granite: each sublayer's output times this joins the residual
    final_norm: bool = True
    # feed-forward
    hidden_act: str = "silu"  # "silu" | "gelu" | "gelu_tanh" | "relu" | "relu2"
    ffn_gated: bool = True  # act(gate(x)) * up(x): SwiGLU with silu, GeGLU with gelu
    mlp_bias: bool = False
    # attention
    attention_bias: bool = False  # q, k, v projections
    attention_out_bias: bool = False  # o projection
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    qk_norm_scope: str = "head"  # "head" | "projection" (OLMo 2: one norm over all heads of q, of k)
    attention_scale: float = 0.0  # 0: derived (1/sqrt(head_dim))
    attn_logit_softcapping: float | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head that takes softmax mass
    clip_qkv: float | None = None  # OLMoE: q, k and v clipped to [-clip_qkv, clip_qkv]
    sliding_window: int | None = None
    # per layer: "full_attention" | "sliding_attention", or a recurrent kind (model/mixers.py)
    layer_types: tuple[str, ...] = ()
    # positions
    position_embedding: str = "rope"  # "rope" | "learned" | "sinusoidal" | "none"
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # Gemma 3, OLMo 3: sliding layers' own base, never scaled
    rope_layers: tuple[bool, ...] = ()  # per layer: rotate q and k? () = every layer (SmolLM 3 skips some)
    rope_traditional: bool = False  # True: rotate adjacent pairs (GPT-J, llama2.c)
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3"|"yarn", ...}
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    # embeddings and head
    tie_word_embeddings: bool = True
    embedding_scale: float | None = None  # Gemma: sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    logit_scale: float = 1.0  # Cohere multiplies the logits, Granite divides them
    lm_head_bias: bool = False  # Phi-2
    # mixture of experts (mlx_tfm/model/experts.py); num_experts 0: every layer dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # 0: derived (= intermediate_size)
    router_scoring: str = "softmax"  # "softmax" | "topk_softmax" | "sigmoid" | "sparsemixer" (experts.route)
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    router_bias: bool = False  # gpt-oss: the router has a bias
    routed_scaling_factor: float = 1.0  # sigmoid routers: weights times this
    n_group: int = 1  # sigmoid routers: experts chosen from the best topk_group of n_group groups
    topk_group: int = 1
    expert_bias: bool = False  # gpt-oss: the experts' projections have biases
    swiglu_limit: float | None = None  # gpt-oss: the experts' clamped SwiGLU (experts.clamped_swiglu)
    swiglu_alpha: float = 1.0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE, GLM-4.5: a dense FFN beside the experts
    shared_expert_gate: bool = False  # Qwen2-MoE: ... scaled by sigmoid(shared_expert_gate(x))
    # dense layers mixed in: layer i has experts unless i in mlp_only_layers,
    # (i + 1) % decoder_sparse_step != 0 or i < first_k_dense_replace
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    # the three architectures (docs/model.md, "Three architectures"): "decoder" (GPT, Llama),
    # "encoder" (BERT family: bidirectional, mlx_tfm/model/encoders.py) or "encoder-decoder" (T5)
    kind: str = "decoder"
    # encoders' embeddings: token types (BERT), a norm over the summed embeddings (BERT,
    # ModernBERT), learned positions after an offset (RoBERTa, XLM-R: padding_idx + 1)
    type_vocab_size: int = 0
    embedding_norm: bool = False
    position_offset: int = 0
    first_layer_norm: bool = True  # False: layer 0 reads the normed embeddings as they are (ModernBERT)
    # T5: a learned bias per head for buckets of key - query distance (mlx_tfm/model/relative_positions.py)
    relative_attention_num_buckets: int = 0
    relative_attention_max_distance: int = 128
    cross_attention: bool = False  # decoder blocks of an encoder-decoder: queries over the encoder's output
    own_embeddings: bool = True  # False: the stack receives embedded inputs (T5's stacks share one table)
    num_decoder_layers: int = 0  # encoder-decoder: 0 = num_hidden_layers
    decoder_start_token_id: int = 0
    # encoders' heads (mlx_tfm/model/heads.py): "none" (hidden states), "masked_lm", "classification"
    head: str = "none"
    num_labels: int = 0
    head_activation: str = "gelu"  # masked LM: dense -> this -> LayerNorm -> decoder
    head_bias: bool = True  # the heads' dense layers
    decoder_bias: bool = True  # the masked-LM decoder's bias
    classifier_pooling: str = "cls"  # "cls" | "mean"
    classifier_activation: str = "tanh"
    classifier_norm: bool = False
    # -- more families (mlx_tfm/families/more_*.py) --
    # ERNIE 4.5 MoE: a softmax router whose choice (not its weights) adds the learned
    # per-expert e_score_correction_bias, as sigmoid routers always do
    router_choice_bias: bool = False
    # PhiMoE's sparsemixer router (router_scoring "sparsemixer"): the relative band of logits
    # near each chosen expert that its weight's softmax runs over
    router_jitter_eps: float = 0.01
    # Ministral 3 (Llama 4's attention temperature): queries after RoPE times
    # 1 + beta * log(1 + floor(position / period)); 0 = off
    query_position_scale_beta: float = 0.0
    query_position_scale_period: int = 0
    # HunYuan: q/k norm (per head) after RoPE instead of before
    qk_norm_after_rope: bool = False

    # Mamba-2 (SSD) token mixers, layer type "mamba" (model/mamba.py, model/ssd.py), and blocks
    # with one sublayer (Mamba-2's mixer-only blocks; Nemotron-H's mixer-only and MLP-only ones)
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0  # N, per group of B and C
    mamba_n_groups: int = 1
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 256  # positions per chunk of the SSD scan over a prompt
    mamba_proj_bias: bool = False  # in_proj
    mamba_out_proj_bias: bool = False
    mamba_conv_bias: bool = True
    mamba_time_step_limit: tuple[float, float] = (0.0, float("inf"))  # dt clipped to this range
    mamba_gated_norm: bool = True  # False (Falcon-H1's mamba_rms_norm off): y * silu(z), no norm
    mamba_norm_before_gate: bool = False
    mamba_norm_eps: float = 1e-5
    mamba_inner_size: int = 0  # Mamba-1 (layer type "mamba1"): the inner width
    mamba_dt_rank: int = 0  # Mamba-1: dt's low-rank width (x_proj -> dt_proj)
    block_sublayers: tuple[str, ...] = ()  # per layer: "mixer+mlp" (() = every layer) | "mixer" | "mlp"
    mamba_beside_attention: bool = False  # Falcon-H1: each attention layer has a Mamba-2 mixer beside it
    # multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash; mlx_tfm/model/latent_attention.py):
    # kv_lora_rank > 0 makes every attention layer MLA; q_lora_rank 0 = a plain q_proj
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # short convolutions (LFM2's "conv" layers, mlx_tfm/model/short_conv.py): a causal
    # depthwise convolution over the last conv_L_cache positions, gated before and after
    conv_L_cache: int = 3
    conv_bias: bool = False  # in_proj, the convolution and out_proj carry biases
    # Gated DeltaNet linear attention (model/deltanet.py, the "linear_attention" layer type)
    # and Qwen3-Next's gated attention output: q_proj emits each head's queries and a gate,
    # and sigmoid(gate) scales the attention output before o_proj
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 16  # prompts run the delta rule this many positions at a time (deltanet.py: why 16)
    attn_output_gate: bool = False
    # Llama 4 (mlx_tfm/model/local_attention.py): "chunked_attention" layers see only the keys of
    # their own chunk of attention_chunk_size positions; an L2 q/k norm (no weight) on the
    # rotating layers; the layers without RoPE scale their queries up with the position
    # (attention temperature tuning); the router's weight scales each expert's input
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    router_scales_input: bool = False
    # Gemma 4 (model/kv_sharing.py, model/per_layer_inputs.py): full-attention layers with their
    # own head size and KV heads (0: as the others), keys doubling as values there; values
    # RMS-normed without a scale; the last num_kv_shared_layers layers attend with the keys and
    # values of the last earlier layer of their type and keep no cache (their FFN twice as
    # wide with double_wide_mlp); a second embedding table and a projection of the embeddings
    # giving each layer an input of hidden_size_per_layer_input; each block's output times a
    # learned layer_scalar; experts_beside_mlp experts routed beside each dense FFN
    # (model/experts_beside_mlp.py, num_experts_per_tok of them per token, each moe_intermediate_size wide)
    global_head_dim: int = 0
    num_global_key_value_heads: int = 0
    attention_k_eq_v: bool = False
    value_norm: bool = False
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    layer_scalar: bool = False
    experts_beside_mlp: int = 0
    # Nemotron-H's experts (model/experts.py SwitchMLP): ungated, down(act(up(x))) with
    # hidden_act (squared ReLU), no gate_proj
    ungated_experts: bool = False
    # MiniMax-Text-01 (norm_placement "normed_residual", model/lightning.py): each sublayer's
    # residual is its normed input, ``alpha * normed + beta * sublayer(normed)``; the
    # mixers' (alpha, beta) by layer type (absent: (1, 1)), the feed-forward's one pair
    mixer_residual_factors: dict | None = None
    mlp_residual_factors: tuple[float, float] = (1.0, 1.0)

    # Vision-language models: the tower's and the projector's settings (model/vision_args.py)
    vision: dict | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        """Build from a dict, ignoring unknown keys and deriving the defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in params.items() if k in names and v is not None}
        n_heads = values.get("num_attention_heads", cls.num_attention_heads)
        hidden = values.get("hidden_size", cls.hidden_size)
        n_layers = values.get("num_hidden_layers", cls.num_hidden_layers)
        values.setdefault("num_key_value_heads", n_heads)
        values["num_key_value_heads"] = values["num_key_value_heads"] or n_heads
        check_head_counts(n_heads, values["num_key_value_heads"], hidden, values.get("head_dim"))
        values["head_dim"] = values.get("head_dim") or hidden // n_heads
        values["attention_scale"] = values.get("attention_scale") or values["head_dim"] ** -0.5
        window = values.get("sliding_window")
        default_type = "sliding_attention" if window else "full_attention"
        values["layer_types"] = tuple(values.get("layer_types") or (default_type,) * n_layers)
        if len(values["layer_types"]) != n_layers:
            raise ValueError(f"layer_types has {len(values['layer_types'])} entries for {n_layers} layers")
        values["rope_layers"] = tuple(bool(r) for r in values.get("rope_layers", ()))
        if values["rope_layers"] and len(values["rope_layers"]) != n_layers:
            raise ValueError(f"rope_layers has {len(values['rope_layers'])} entries for {n_layers} layers")
        values.update(expert_values(values, cls))
        values.update(state_space_values(values, n_layers, cls))
        return cls(**values)

    def has_experts(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s feed-forward is a mixture of experts."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0 and layer_idx >= self.first_k_dense_replace)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("layer_types", "rope_layers", "mlp_only_layers", "block_sublayers", "mamba_time_step_limit"):
            d[name] = list(d[name])  # JSON's lists, as config files hold them
        return d


def check_head_counts(n_heads: int, n_kv_heads: int, hidden_size: int, head_dim: int | None) -> None:
    """ValueError naming the numbers when the attention heads cannot be laid out: each KV
    head serves a whole group of query heads, and without an explicit head_dim the heads
    split hidden_size evenly."""
    for name, count in (("num_attention_heads", n_heads), ("num_key_value_heads", n_kv_heads)):
        if count < 1:
            raise ValueError(f"{name} must be at least 1, not {count}")
    if n_heads % n_kv_heads:
        raise ValueError(f"num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv_heads})")
    if not head_dim and hidden_size % n_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({n_heads}) and there is no head_dim"
        )


def state_space_values(values: dict, n_layers: int, defaults) -> dict:
    """The list-valued Mamba fields of ModelArgs as tuples (JSON gives lists), checked per layer;
    ``defaults`` is the class, for its default values."""
    sublayers = tuple(values.get("block_sublayers", ()))
    if sublayers and len(sublayers) != n_layers:
        raise ValueError(f"block_sublayers has {len(sublayers)} entries for {n_layers} layers")
    unknown = sorted(set(sublayers) - {"mixer+mlp", "mixer", "mlp"})
    if unknown:
        raise ValueError(f"unknown block_sublayers entry {unknown[0]!r} (mixer+mlp, mixer, mlp)")
    limit = tuple(float(v) for v in values.get("mamba_time_step_limit", defaults.mamba_time_step_limit))
    return {"block_sublayers": sublayers, "mamba_time_step_limit": limit}


def expert_values(values: dict, defaults) -> dict:
    """The expert fields ModelArgs derives: the experts' width (the dense FFN's by default), checked counts."""
    n_experts, per_token = values.get("num_experts", 0), values.get("num_experts_per_tok", 0)
    if n_experts and not 0 < per_token <= n_experts:
        raise ValueError(f"num_experts_per_tok is {per_token}; it must be between 1 and num_experts ({n_experts})")
    return {
        "moe_intermediate_size": values.get("moe_intermediate_size") or values.get("intermediate_size",
                                                                                   defaults.intermediate_size),
        "mlp_only_layers": tuple(values.get("mlp_only_layers", ())),
    }
