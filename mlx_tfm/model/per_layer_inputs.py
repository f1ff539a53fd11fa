"""Per-layer inputs (Gemma 4's per-layer embeddings): every layer gets its own small input
of ``hidden_size_per_layer_input`` (P) numbers per token, the mean of a lookup in a second
embedding table (all layers' slices packed in one row) and a normed projection of the
token's embedding. After its feed-forward, each block gates that input with its own
hidden state, projects it back to D, norms it and adds it to the stream.

Parameter names follow the checkpoints: ``model.embed_tokens_per_layer``,
``model.per_layer_model_projection``, ``model.per_layer_projection_norm`` on the stack;
``per_layer_input_gate``, ``per_layer_projection``, ``post_per_layer_input_norm`` on each
block.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .layers import ACTIVATIONS, RMSNorm


def stack_modules(args: ModelArgs) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The stack's table (vocab, n_layers * P), projection (D -> n_layers * P) and norm (P)."""
    packed = args.num_hidden_layers * args.hidden_size_per_layer_input
    vocab = args.vocab_size_per_layer_input or args.vocab_size
    return (nn.Embedding(vocab, packed), nn.Linear(args.hidden_size, packed, bias=False),
            RMSNorm(args.hidden_size_per_layer_input, args.norm_eps))


def block_modules(args: ModelArgs) -> tuple[nn.Module, nn.Module, nn.Module]:
    """A block's gate (D -> P), projection (P -> D) and the norm of its output (D)."""
    P, D = args.hidden_size_per_layer_input, args.hidden_size
    return nn.Linear(D, P, bias=False), nn.Linear(P, D, bias=False), RMSNorm(D, args.norm_eps)


def per_layer_inputs(stack: nn.Module, tokens: mx.array, embedded: mx.array) -> mx.array:
    """Token ids (B, L) and their scaled embeddings (B, L, D) -> every layer's input
    (B, L, n_layers, P): (table lookup * sqrt(P) + norm(projection / sqrt(D))) / sqrt(2)."""
    args = stack.args
    B, L = tokens.shape
    P = args.hidden_size_per_layer_input
    looked_up = stack.embed_tokens_per_layer(tokens)
    looked_up = looked_up * mx.array(P**0.5, dtype=looked_up.dtype)
    projected = stack.per_layer_model_projection(embedded) * (args.hidden_size**-0.5)
    # (B, L, n_layers * P) -> (B, L, n_layers, P)
    looked_up = looked_up.reshape(B, L, args.num_hidden_layers, P)
    projected = stack.per_layer_projection_norm(projected.reshape(B, L, args.num_hidden_layers, P))
    return (projected + looked_up) * (2.0**-0.5)


def add_per_layer_input(block: nn.Module, h: mx.array, layer_input: mx.array, act: str) -> mx.array:
    """A block's output (B, L, D) plus its gated per-layer input (B, L, P)."""
    gated = ACTIVATIONS[act](block.per_layer_input_gate(h)) * layer_input  # (B, L, P)
    return h + block.post_per_layer_input_norm(block.per_layer_projection(gated))
