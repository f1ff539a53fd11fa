"""Gemma 4's vision tower and its embedder into the language model (the image side of
``gemma4`` checkpoints), from cut patches to one row per soft token.

The processor hands the tower patches already cut (``pixel_values`` (N, max_patches,
3 * p * p), pixels in [0, 1]) with each patch's (x, y) in its image's patch grid
(``image_position_ids`` (N, max_patches, 2), -1 for padding). Each patch is mapped to
[-1, 1], through one linear map, and gets two learned position rows added (one by x, one by
y). The blocks are Gemma's sandwich: RMSNorm before and after attention and the gated MLP;
queries and keys are RMS-normed per head (with a scale), values too (without), attention
is unscaled (1.0), and each head's first half is rotated by the patch's x, its second half
by its y (each half rotated as Llama rotates a whole head). Linear maps may clamp their
inputs and outputs (``use_clipped_linears``: four scalars each, from the checkpoint).

Then each k x k block of patches (k = ``pooling_kernel_size``) is averaged into one soft
token, scaled by sqrt(D), optionally standardised (``std_bias``, ``std_scale``), and the
embedder (``embed_vision``) RMS-norms it without a scale and projects it to the language
model's width. Each image runs alone: Gemma 4 masks the padding, which is the same.

Shapes: P patches of one image, T its soft tokens, D the tower's width, hd a head's width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .layers import ACTIVATIONS, RMSNorm
from .per_layer_inputs import per_layer_inputs
from .transformer import Model
from .vision_args import VisionArgs
from .vision_language import VisionLanguageModel, scatter_image_features


@dataclass(frozen=True)
class Gemma4VisionArgs:
    """The tower's fields (``VisionArgs.tower_fields`` holds them), as Gemma4VisionConfig."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_act: str = "gelu_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10240
    use_clipped_linears: bool = False
    standardize: bool = False
    pad_token_id: int = 0  # the language model's: what its per-layer inputs see at image tokens

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "Gemma4VisionArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in names and v is not None})


class ClippableLinear(nn.Module):
    """A bias-free ``linear``; with ``clipped``, its input and output clamped to the
    checkpoint's ``input_min``/``input_max`` and ``output_min``/``output_max``."""

    def __init__(self, in_dims: int, out_dims: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        if clipped:
            self.input_min, self.input_max = mx.array(-math.inf), mx.array(math.inf)
            self.output_min, self.output_max = mx.array(-math.inf), mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if "input_min" not in self:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        out = self.linear(x)
        return mx.clip(out, self.output_min.astype(out.dtype), self.output_max.astype(out.dtype))


def axial_cos_sin(positions: mx.array, head_dim: int, theta: float) -> tuple[mx.array, mx.array]:
    """(P, 2) patch (x, y) -> cos, sin (P, hd): the first hd / 2 channels turn with x, the
    rest with y, each half laid out as Llama lays out a head (its frequencies twice)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (mx.arange(0, half, 2, dtype=mx.float32) / half))  # (hd / 4,)
    x_angles = positions[:, :1].astype(mx.float32) * inv_freq  # (P, hd / 4)
    y_angles = positions[:, 1:].astype(mx.float32) * inv_freq
    angles = mx.concatenate([x_angles, x_angles, y_angles, y_angles], axis=-1)  # (P, hd)
    return mx.cos(angles), mx.sin(angles)


def rotate_halves(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (..., P, hd): each half of the head rotated on its own (Llama's half rotation)."""
    def rotated(part: mx.array) -> mx.array:
        n = part.shape[-1] // 2
        return mx.concatenate([-part[..., n:], part[..., :n]], axis=-1)

    half = x.shape[-1] // 2
    turned = mx.concatenate([rotated(x[..., :half]), rotated(x[..., half:])], axis=-1)
    return x * cos + turned * sin


class Gemma4VisionAttention(nn.Module):
    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        clipped, D = args.use_clipped_linears, args.hidden_size
        self.q_proj = ClippableLinear(D, self.n_heads * self.head_dim, clipped)
        self.k_proj = ClippableLinear(D, self.n_kv_heads * self.head_dim, clipped)
        self.v_proj = ClippableLinear(D, self.n_kv_heads * self.head_dim, clipped)
        self.o_proj = ClippableLinear(self.n_heads * self.head_dim, D, clipped)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.eps = args.rms_norm_eps

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        B, P, _ = x.shape

        def heads(t: mx.array, n: int) -> mx.array:  # (B, P, n * hd) -> (B, n, P, hd)
            return t.reshape(B, P, n, self.head_dim).transpose(0, 2, 1, 3)

        queries = rotate_halves(self.q_norm(heads(self.q_proj(x), self.n_heads)), cos, sin)
        keys = rotate_halves(self.k_norm(heads(self.k_proj(x), self.n_kv_heads)), cos, sin)
        values = mx.fast.rms_norm(heads(self.v_proj(x), self.n_kv_heads), None, self.eps)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, P, -1))  # (B, P, n_heads * hd)


class Gemma4VisionMLP(nn.Module):
    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        clipped = args.use_clipped_linears
        self.gate_proj = ClippableLinear(args.hidden_size, args.intermediate_size, clipped)
        self.up_proj = ClippableLinear(args.hidden_size, args.intermediate_size, clipped)
        self.down_proj = ClippableLinear(args.intermediate_size, args.hidden_size, clipped)
        self.act = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionLayer(nn.Module):
    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        D, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Gemma4VisionAttention(args)
        self.mlp = Gemma4VisionMLP(args)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(D, eps), RMSNorm(D, eps)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma4VisionEncoder(nn.Module):
    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        self.layers = [Gemma4VisionLayer(args) for _ in range(args.num_hidden_layers)]

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class Gemma4PatchEmbedder(nn.Module):
    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        self.input_proj = nn.Linear(3 * args.patch_size ** 2, args.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, args.position_embedding_size, args.hidden_size))

    def __call__(self, patches: mx.array, positions: mx.array) -> mx.array:
        """(P, 3 * p * p) in [0, 1] and (P, 2) -> (1, P, D)."""
        h = self.input_proj((2 * (patches - 0.5)).astype(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return (h + table[0][positions[:, 0]] + table[1][positions[:, 1]])[None]


def pool_by_positions(states: mx.array, positions: mx.array, kernel: int) -> mx.array:
    """(P, D) -> (T, D): each k x k block of the patch grid averaged, row-major over blocks;
    the grid's sides must be multiples of k."""
    cols, rows = (int(m) + 1 for m in positions.max(axis=0).tolist())
    if cols % kernel or rows % kernel:
        raise ValueError(f"a {rows}x{cols} patch grid does not pool by {kernel}x{kernel} blocks")
    blocks = positions[:, 0] // kernel + (cols // kernel) * (positions[:, 1] // kernel)  # (P,)
    n_blocks = (rows // kernel) * (cols // kernel)
    weights = (mx.arange(n_blocks)[:, None] == blocks[None, :]).astype(mx.float32) / kernel ** 2  # (T, P)
    return weights @ states.astype(mx.float32)


class Gemma4VisionTower(nn.Module):
    """``tower(patches (P, 3 * p * p), positions (P, 2))`` -> soft tokens (T, D), float32."""

    def __init__(self, args: Gemma4VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embedder = Gemma4PatchEmbedder(args)
        self.encoder = Gemma4VisionEncoder(args)
        if args.standardize:
            self.std_bias, self.std_scale = mx.zeros((args.hidden_size,)), mx.ones((args.hidden_size,))

    def __call__(self, patches: mx.array, positions: mx.array) -> mx.array:
        h = self.patch_embedder(patches, positions)
        cos, sin = axial_cos_sin(positions, self.args.head_dim, self.args.rope_theta)
        states = self.encoder(h, cos.astype(h.dtype), sin.astype(h.dtype))[0]  # (P, D)
        pooled = pool_by_positions(states, positions, self.args.pooling_kernel_size) * math.sqrt(self.args.hidden_size)
        if "std_bias" in self:
            pooled = (pooled - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return pooled.astype(h.dtype)


class Gemma4VisionEmbedder(nn.Module):
    """``embed_vision``: an unscaled RMSNorm, then the projection to the text model's width."""

    def __init__(self, args: Gemma4VisionArgs, text_hidden_size: int):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.embedding_projection = nn.Linear(args.hidden_size, text_hidden_size, bias=False)

    def __call__(self, soft_tokens: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(soft_tokens, None, self.eps))


def encode_gemma4_images(tower: Gemma4VisionTower, embedder: Gemma4VisionEmbedder, pixel_values: mx.array,
                         image_position_ids: mx.array) -> mx.array:
    """Cut patches (N, max_patches, 3 * p * p) and positions (N, max_patches, 2), -1 for
    padding -> features (n_soft_tokens, D_text), image by image."""
    features = []
    for patches, positions in zip(pixel_values, mx.array(image_position_ids)):
        n_real = int((positions[:, 0] >= 0).sum().item())  # the padding comes last
        features.append(embedder(tower(patches[:n_real], positions[:n_real].astype(mx.int32))))
    return mx.concatenate(features) if features else mx.zeros((0, embedder.embedding_projection.weight.shape[0]))


class Gemma4VisionLanguageModel(VisionLanguageModel):
    """Gemma 4 with images: ``language_model``, ``vision_tower``, ``embed_vision``. The
    image tokens' embeddings are the features; their per-layer inputs look the pad token up
    and project the features (as transformers does)."""

    def __init__(self, args: ModelArgs):
        # VisionLanguageModel.__init__ builds the fixed-size ViT; this model builds its own
        nn.Module.__init__(self)
        self.args = args
        self.vision_args = VisionArgs.from_dict(args.vision)
        self.gemma4 = Gemma4VisionArgs.from_dict(self.vision_args.tower_fields)
        self.language_model = Model(dataclasses.replace(args, vision=None))
        self.vision_tower = Gemma4VisionTower(self.gemma4)
        self.embed_vision = Gemma4VisionEmbedder(self.gemma4, args.hidden_size)

    def encode_images(self, pixel_values: mx.array, image_position_ids=None) -> mx.array:
        """Cut patches (N, max_patches, 3 * p * p) and their (x, y), -1 for padding ->
        features (n_soft_tokens, D)."""
        if image_position_ids is None:
            raise ValueError("Gemma 4's tower needs each patch's position (image_position_ids)")
        return encode_gemma4_images(self.vision_tower, self.embed_vision, pixel_values, image_position_ids)

    def __call__(self, inputs: mx.array, mask=None, cache: list | None = None,
                 image_features: mx.array | None = None) -> mx.array:
        if image_features is None:
            return self.language_model(inputs, mask, cache)
        is_image = inputs == self.vision_args.image_token_id
        text_ids = mx.where(is_image, self.gemma4.pad_token_id, inputs)
        stack = self.language_model.model
        embedded = stack.embed_tokens(text_ids)
        if self.args.embedding_scale is not None:
            embedded = embedded * mx.array(self.args.embedding_scale, dtype=embedded.dtype)
        embeddings = scatter_image_features(embedded, is_image, image_features)
        per_layer = per_layer_inputs(stack, text_ids, embeddings) if self.args.hidden_size_per_layer_input else None
        return self.language_model(inputs, mask, cache, input_embeddings=embeddings, per_layer_input=per_layer)
