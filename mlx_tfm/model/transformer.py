"""The Transformer, as the classic explanations draw it, in one configurable implementation.

Every variant (RMSNorm or LayerNorm; pre-, post- or sandwich norm; SwiGLU, GeGLU, GELU,
ReLU; MHA, MQA, GQA; RoPE, learned or sinusoidal positions; tied embeddings; biases;
soft-capping) is a field of the frozen ``ModelArgs``. This file holds only math: loading,
converting and sampling live elsewhere. Parameter names follow Hugging Face's Llama
(``model.layers.N.self_attn.q_proj``...), so checkpoints load by near-copy.

Shapes: B batch, L new positions, S cached positions, D hidden size.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cpu import pointwise as cpu_pointwise
from ..cpu.switch import evaluates_each_sublayer
from .attention import Attention
from .cache import CrossAttentionCache, KVCache, RotatingKVCache, window_mask
from .chunked_cache import layer_chunked_mask
from .config import ModelArgs
from .experts import SparseMoeBlock, clamped_swiglu
from .experts_beside_mlp import add_modules as add_beside_experts
from .experts_beside_mlp import with_experts
from .kv_sharing import first_shared_layer, kv_sources, wire_shared_caches
from .layers import ACTIVATIONS, MLP, gated_activation, make_norm
from .mamba import Mamba2Mixer, ParallelCache
from .mixers import ATTENTION_TYPES, mixer_kind
from .mrope import ExplicitPositions
from .per_layer_inputs import add_per_layer_input, block_modules, per_layer_inputs, stack_modules
from .positions import SinusoidalPositions, position_ids
from .relative_positions import relative_position_bias
from .state_cache import StateCache


def feed_forward(args: ModelArgs, layer_idx: int) -> nn.Module:
    """The layer's FFN: the dense MLP, or a mixture of experts (with its shared expert)."""
    if not args.has_experts(layer_idx):
        # Gemma 4's double-wide MLP: the KV-shared layers' FFN is twice as wide
        wide = args.double_wide_mlp and layer_idx >= first_shared_layer(args)
        return MLP(args, 2 * args.intermediate_size if wide else None)
    shared = MLP(args, args.shared_expert_intermediate_size) if args.shared_expert_intermediate_size else None
    if args.ungated_experts:  # Nemotron-H: down(act(up(x))), one argument
        activation = ACTIVATIONS[args.hidden_act]
    elif args.swiglu_limit is not None:
        activation = clamped_swiglu(args.swiglu_alpha, args.swiglu_limit)
    else:
        activation = gated_activation(args.hidden_act)
    return SparseMoeBlock(args, activation, shared)


# Which norms each placement has, by their checkpoint names.
BLOCK_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "post": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "post_sublayer": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "parallel": ("input_layernorm",),
    "parallel_two_norms": ("input_layernorm", "post_attention_layernorm"),  # GPT-NeoX
    "normed_residual": ("input_layernorm", "post_attention_layernorm"),  # MiniMax
}


def settled(h: mx.array) -> mx.array:
    """``h`` (B, L, D), evaluated now while a prompt is read one sublayer at a time
    (``prompt_layer_by_layer``: after each attention and each FFN), so the next
    sublayer's graph is built after; unchanged otherwise."""
    if h.shape[1] > 1 and evaluates_each_sublayer():
        mx.eval(h)
    return h


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.placement = args.norm_placement
        self.residual = args.residual
        self.residual_scale = args.residual_scale
        if self.placement not in BLOCK_NORMS:
            raise ValueError(f"unknown norm_placement {self.placement!r} ({', '.join(BLOCK_NORMS)})")
        if not self.residual and self.placement not in ("pre", "post"):
            raise ValueError("residual=False is only defined for the pre and post placements")
        # Mamba-2's and Nemotron-H's blocks hold one sublayer: a mixer or an MLP, one norm
        self.sublayers = args.block_sublayers[layer_idx] if args.block_sublayers else "mixer+mlp"
        if self.sublayers != "mixer+mlp" and self.placement != "pre":
            raise ValueError("blocks with one sublayer are only defined for the pre-norm placement")
        self.mixer_name = None
        if self.sublayers != "mlp":
            kind = mixer_kind(args.layer_types[layer_idx])
            self.mixer_name = kind.attribute
            setattr(self, kind.attribute, kind.build(args, layer_idx))
        if self.sublayers != "mixer":
            self.mlp = feed_forward(args, layer_idx)
        if args.mamba_beside_attention:  # Falcon-H1: both read the same normed input
            if self.placement != "pre" or self.mixer_name != "self_attn":
                raise ValueError("a Mamba-2 mixer beside attention needs pre-norm attention layers")
            self.mamba = Mamba2Mixer(args, layer_idx)
        for name in BLOCK_NORMS[self.placement] if self.sublayers == "mixer+mlp" else ("input_layernorm",):
            setattr(self, name, make_norm(args))
        if layer_idx == 0 and not args.first_layer_norm:
            self.input_layernorm = nn.Identity()  # ModernBERT: the embeddings are normed already
        if args.cross_attention:
            if self.placement != "pre":
                raise ValueError("cross-attention is only defined for the pre-norm placement")
            self.cross_attn = Attention(args, layer_idx)
            self.cross_attn_layernorm = make_norm(args)
        self.per_layer_act = args.hidden_act if args.hidden_size_per_layer_input else None
        if self.per_layer_act:  # Gemma 4 (per_layer_inputs.py)
            self.per_layer_input_gate, self.per_layer_projection, self.post_per_layer_input_norm = block_modules(args)
        self.experts_beside = args.experts_beside_mlp > 0
        if self.experts_beside:  # Gemma 4 (experts_beside_mlp.py)
            if self.placement != "sandwich":
                raise ValueError("experts beside the MLP are only defined for the sandwich placement")
            add_beside_experts(self, args)
        if self.placement == "normed_residual":  # MiniMax: weighted residuals of the normed stream
            factors = (args.mixer_residual_factors or {}).get(args.layer_types[layer_idx], (1.0, 1.0))
            (self.mixer_alpha, self.mixer_beta), (self.mlp_alpha, self.mlp_beta) = factors, args.mlp_residual_factors
        self.scales_output = args.layer_scalar
        if self.scales_output:  # Gemma 4: a learned scalar times the block's output
            self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, mask=None, cache=None, cross: CrossAttentionCache | None = None,
                 per_layer_input: mx.array | None = None) -> mx.array:
        """x (B, L, D) -> (B, L, D); ``per_layer_input`` (B, L, P): this layer's own input
        (Gemma 4), added gated after the FFN."""
        h = self._sublayers(x, mask, cache, cross)
        if self.per_layer_act:
            h = add_per_layer_input(self, h, per_layer_input, self.per_layer_act)
        return h * self.layer_scalar if self.scales_output else h

    def _sublayers(self, x: mx.array, mask, cache, cross: CrossAttentionCache | None) -> mx.array:
        if self.sublayers != "mixer+mlp":
            return self._one_sublayer(x, mask, cache)
        if not self.residual:
            return self._without_residual(x, mask, cache)
        if self.placement == "post":
            # The original Transformer: normalise after each residual addition.
            h = settled(self.input_layernorm(x + self.mixer(x, mask, cache)))
            return self.post_attention_layernorm(h + self.mlp(h))
        if self.placement == "pre":
            # The residual stream as the seed draws it: each sublayer adds to x.
            h = settled(x + self._scaled(self._mixed(self.input_layernorm(x), mask, cache)))
            if cross is not None:  # encoder-decoder: the decoder reads the encoder's output
                h = settled(h + self.cross_attn(self.cross_attn_layernorm(h), None, cross))
            return h + self._scaled(self.mlp(self.post_attention_layernorm(h)))
        if self.placement == "parallel":
            # Phi-2, Cohere: both sublayers read the same normalised x.
            normed = self.input_layernorm(x)
            return x + self.mixer(normed, mask, cache) + self.mlp(normed)
        if self.placement == "parallel_two_norms":
            # GPT-NeoX: both sublayers read x, each through its own norm.
            return x + self.mixer(self.input_layernorm(x), mask, cache) + self.mlp(self.post_attention_layernorm(x))
        if self.placement == "normed_residual":
            # MiniMax: the residual is each sublayer's normed input, both terms weighted.
            h = self.input_layernorm(x)
            h = settled(h * self.mixer_alpha + self.mixer(h, mask, cache) * self.mixer_beta)
            h = self.post_attention_layernorm(h)
            return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta
        if self.placement == "post_sublayer":
            # OLMo 2: normalise each sublayer's output only.
            h = settled(x + self.post_attention_layernorm(self.mixer(x, mask, cache)))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        # Gemma 2 and 3: normalise each sublayer's input and its output.
        h = settled(x + self.post_attention_layernorm(self.mixer(self.input_layernorm(x), mask, cache)))
        ffn = self.mlp(self.pre_feedforward_layernorm(h))
        if self.experts_beside:  # Gemma 4: routed experts beside the dense FFN
            ffn = with_experts(self, h, ffn)
        return h + self.post_feedforward_layernorm(ffn)

    @property
    def mixer(self) -> nn.Module | None:
        """The layer's token mixer: attention, or a recurrent kind (``mixers.MIXERS``);
        None in an MLP-only block."""
        return self[self.mixer_name] if self.mixer_name is not None else None

    def _mixed(self, normed: mx.array, mask, cache) -> mx.array:
        """The mixer's output; with a Mamba-2 mixer beside the attention (Falcon-H1), both
        read ``normed`` and their outputs add (``cache`` a ``ParallelCache``)."""
        if "mamba" not in self or self.mixer_name == "mamba":
            return self.mixer(normed, mask, cache)
        attention_cache, state = (cache.attention, cache.mamba) if cache is not None else (None, None)
        return self.mixer(normed, mask, attention_cache) + self.mamba(normed, None, state)

    def _one_sublayer(self, x: mx.array, mask, cache) -> mx.array:
        """A block of one sublayer, pre-norm: x + mixer(norm(x)), or x + mlp(norm(x)). An
        MLP-only block still counts the positions in its (empty) cache, so every layer's
        cache holds the same offset."""
        normed = self.input_layernorm(x)
        if self.mixer_name is not None:
            return x + self._scaled(self.mixer(normed, mask, cache))
        if cache is not None:
            cache.advance(x.shape[1])
        return x + self._scaled(self.mlp(normed))

    def _scaled(self, y: mx.array) -> mx.array:
        return y * self.residual_scale if self.residual_scale != 1.0 else y

    def _without_residual(self, x: mx.array, mask, cache) -> mx.array:
        """The same sublayers and norms with no skip connections: each sublayer's output
        replaces the stream instead of adding to it (only for gradient-flow experiments)."""
        if self.placement == "post":
            h = self.input_layernorm(self.mixer(x, mask, cache))
            return self.post_attention_layernorm(self.mlp(h))
        h = self.mixer(self.input_layernorm(x), mask, cache)
        return self.mlp(self.post_attention_layernorm(h))


def bidirectional_window(mask, length: int, window: int):
    """An encoder's sliding-window layer (ModernBERT's local attention): position i sees
    j when |i - j| <= window, and j is a token (``mask`` (B, 1, 1, S) or None)."""
    positions = mx.arange(length)
    band = mx.abs(positions[:, None] - positions[None, :]) <= window  # (L, L)
    return band if mask is None else band & mask


class TransformerModel(nn.Module):
    """Embeddings, the stack of blocks, the final norm: ``model.*`` in checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        if args.own_embeddings:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if args.position_embedding == "learned":
            self.embed_positions = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        elif args.position_embedding == "sinusoidal":
            self.sinusoidal = SinusoidalPositions(args.hidden_size)
        if args.type_vocab_size:
            self.embed_token_types = nn.Embedding(args.type_vocab_size, args.hidden_size)
        if args.embedding_norm:
            self.embed_norm = make_norm(args)
        if args.relative_attention_num_buckets:
            self.relative_attention_bias = nn.Embedding(args.relative_attention_num_buckets, args.num_attention_heads)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.windows = [args.sliding_window if t == "sliding_attention" else None for t in args.layer_types]
        self.chunks = [args.attention_chunk_size if t == "chunked_attention" else None for t in args.layer_types]
        if "chunked_attention" in args.layer_types and not args.attention_chunk_size:
            raise ValueError("chunked_attention layers need attention_chunk_size")
        if args.final_norm:
            self.norm = make_norm(args)
        if args.hidden_size_per_layer_input:  # Gemma 4 (per_layer_inputs.py)
            self.embed_tokens_per_layer, self.per_layer_model_projection, self.per_layer_projection_norm = (
                stack_modules(args))

    def __call__(self, inputs: mx.array, mask=None, cache=None, token_type_ids: mx.array | None = None,
                 cross: list[CrossAttentionCache] | None = None, input_embeddings: mx.array | None = None,
                 positions: mx.array | None = None, per_layer_input: mx.array | None = None) -> mx.array:
        """Token ids (B, L), or embedded inputs (B, L, D) when the stack does not own its
        embeddings, -> hidden states (B, L, D). Encoders (kind "encoder") attend both ways:
        ``mask`` is then their padding mask (B, 1, 1, S), True at tokens. ``cross``: one
        ``CrossAttentionCache`` per layer of an encoder-decoder's decoder. ``input_embeddings``
        (B, L, D): the embedded (and scaled) tokens to run instead of looking ``inputs`` up,
        as a vision-language model makes them (model/vision_language.py). ``positions``
        (3, B, L): M-RoPE's explicit positions of the tokens (``mrope.py``). ``per_layer_input``
        (B, L, n_layers, P): Gemma 4's per-layer inputs made by the caller (its image-text
        model computes them from other ids and embeddings than the ones it runs)."""
        B, L = inputs.shape[:2]
        if input_embeddings is not None:
            h = input_embeddings
        else:
            h = self.embed_tokens(inputs) if self.args.own_embeddings else inputs  # (B, L, D)
            if self.args.embedding_scale is not None:
                h = h * mx.array(self.args.embedding_scale, dtype=h.dtype)
        offset = cache[0].offset if cache is not None else 0
        if self.args.position_embedding == "learned":
            learned = position_ids(offset, L) + self.args.position_offset  # offset: int, or (B,) per row
            h = h + self.embed_positions(learned)
        elif self.args.position_embedding == "sinusoidal":
            h = h + self.sinusoidal(offset, L).astype(h.dtype)
        if self.args.type_vocab_size:
            types = token_type_ids if token_type_ids is not None else mx.zeros((B, L), mx.int32)
            h = h + self.embed_token_types(types)
        if self.args.embedding_norm:
            h = self.embed_norm(h)
        per_layer = per_layer_input
        if per_layer is None and self.args.hidden_size_per_layer_input:
            per_layer = per_layer_inputs(self, inputs, h)
        masks = self._stack_masks(mask, L, cache, h.dtype)
        cache = cache if cache is not None else [None] * len(self.layers)
        if positions is not None:  # they ride to each attention layer with its cache (Qwen3.5's recurrent ones pass)
            cache = [ExplicitPositions(layer_cache, positions) if kind in ATTENTION_TYPES else layer_cache
                     for layer_cache, kind in zip(cache, self.args.layer_types)]
        if self.args.num_kv_shared_layers:  # Gemma 4: the shared layers read their source's (kv_sharing.py)
            cache = wire_shared_caches(self.args, cache)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if per_layer is not None:
                h = settled(layer(h, masks[i], layer_cache, per_layer_input=per_layer[:, :, i]))
            elif cross is None:
                h = settled(layer(h, masks[i], layer_cache))
            else:
                h = settled(layer(h, masks[i], layer_cache, cross[i]))
        return self.norm(h) if self.args.final_norm else h

    def _stack_masks(self, mask, length: int, cache, dtype: mx.Dtype) -> list:
        """The mask each layer attends with (computed before any layer updates its cache).
        Decoders: ``mask`` as given, else causal and windowed from each cache; encoders:
        the padding ``mask`` both ways, banded on sliding-window layers; stacks with T5's
        relative position bias: one additive mask shared by every layer."""
        if isinstance(mask, list):  # one per layer, built by the caller (vision_language.py)
            return mask
        if self.args.relative_attention_num_buckets:
            return [self._biased_mask(mask, length, cache, dtype)] * len(self.layers)
        if self.args.kind == "encoder":
            return [mask if window is None else bidirectional_window(mask, length, window) for window in self.windows]
        caches = cache if cache is not None else [None] * len(self.layers)
        if mask is not None:
            return [mask] * len(self.layers)
        if self.args.num_kv_shared_layers:  # a shared layer attends as its source does
            caches = [caches[source] for source in kv_sources(self.args)]
        return [self._mask(length, c, w) if chunk is None else layer_chunked_mask(c, length, chunk)
                for c, w, chunk in zip(caches, self.windows, self.chunks)]

    def _biased_mask(self, mask, length: int, cache, dtype: mx.Dtype) -> mx.array:
        """T5: the relative position bias (1, n_heads, L, S) of queries at the cache's
        offset, with the padding (encoder) or causal (decoder) mask as the lowest number."""
        offset = cache[0].offset if cache is not None else 0
        encoder = self.args.kind == "encoder"
        bias = relative_position_bias(self.relative_attention_bias.weight, range(offset, offset + length), offset + length,
                                      encoder, self.args.relative_attention_max_distance).astype(dtype)
        if encoder:
            visible = mask
        else:
            visible = window_mask(mx.arange(offset, offset + length), mx.arange(offset + length), None) if length > 1 else None
        return bias if visible is None else mx.where(visible, bias, mx.finfo(dtype).min)

    @staticmethod
    def _mask(length: int, cache, window: int | None):
        if cache is not None:
            return cache.make_mask(length, window)
        if window is not None and length > window:
            positions = mx.arange(length)
            return window_mask(positions, positions, window)
        return "causal" if length > 1 else None


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if not args.num_key_value_heads or not args.head_dim or not args.attention_scale:
            raise ValueError("build ModelArgs with ModelArgs.from_dict, which derives head_dim and friends")
        if args.num_attention_heads % args.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.args = args
        self.model = TransformerModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=args.lm_head_bias)

    def __call__(self, inputs: mx.array, mask=None, cache: list | None = None,
                 input_embeddings: mx.array | None = None, positions: mx.array | None = None,
                 per_layer_input: mx.array | None = None) -> mx.array:
        """Token ids (B, L) -> logits (B, L, vocab_size); ``input_embeddings`` and
        ``per_layer_input``: as ``TransformerModel`` takes them; ``positions`` (3, B, L) for
        M-RoPE (``mrope.py``), else each token's place after the cache's offset."""
        return self.head(self.model(inputs, mask, cache, input_embeddings=input_embeddings, positions=positions,
                                    per_layer_input=per_layer_input))

    def head(self, h: mx.array) -> mx.array:
        """Final hidden states (B, L, D) -> logits (B, L, vocab_size). Separate so that
        training can compute the loss over the vocabulary a chunk of positions at a time."""
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        if self.args.logit_scale != 1.0:
            logits = logits * self.args.logit_scale
        cap = self.args.final_logit_softcapping
        if cap and cap > 0 and cpu_pointwise.in_use():  # MLX's CPU tanh is a scalar loop on one thread
            return cpu_pointwise.soft_cap(logits, cap)
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def make_cache(self, max_kv_size: int | None = None, keep: int = 0) -> list:
        """One cache per layer. Sliding-window layers never need more than their window;
        ``max_kv_size`` bounds every attention layer but chunked ones with a rotating
        cache; recurrent layers make their own (a ``StateCache``, fixed in size)."""
        caches = []
        own_caches = first_shared_layer(self.args)  # KV-shared layers keep none (kv_sharing.py)
        for layer, window, chunk in zip(self.layers[:own_caches], self.model.windows, self.model.chunks):
            if layer.mixer is None:  # an MLP-only block: nothing to remember
                caches.append(StateCache(0))
                continue
            if hasattr(layer.mixer, "make_cache"):  # a recurrent layer: its own fixed-size state
                caches.append(layer.mixer.make_cache())
                continue
            if chunk is not None:  # Llama 4's chunked layers (chunk_bound.chunk_bounded bounds them)
                caches.append(KVCache())
                continue
            bound = min(b for b in (window, max_kv_size) if b is not None) if (window or max_kv_size) else None
            cache = RotatingKVCache(bound, keep=keep if bound == max_kv_size else 0) if bound else KVCache()
            caches.append(ParallelCache(cache, layer.mamba.make_cache()) if self.args.mamba_beside_attention else cache)
        return caches


def count_parameters(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(module.parameters()))
