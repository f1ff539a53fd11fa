"""Decoding steps with less Python: each layer's pure pieces through ``mx.compile``.

A decoding step builds its graph anew for every token: for the 135M model some 460
operations, each through several Python calls (module attribute look-ups, the CPU routes'
checks of which kernel takes a layer). The pieces of a pre-norm block that never see the
cache are pure functions of fixed shapes while one position is decoded:

- ``heads``: ``input_layernorm``, then the q/k/v products and RoPE (the position an array
  input, so one trace serves every step);
- ``finish``: ``o_proj`` of attention's output, the residual, ``post_attention_layernorm``,
  the MLP and its residual.

``mx.compile`` traces each once and replays the recorded graph afterwards, so they are
built in C++; one block's ``finish`` and the next block's ``heads`` are one compiled call. The cache update and attention itself (whose length grows every step) stay
plain calls between them, as do the embedding, the final norm and the head. The traced
graph is made of the same operations, so the numbers are the same as the plain call's.

``CompiledDecoder.takes(model)`` says which models this covers (plain pre-norm decoders
of attention and dense MLP layers); the others decode through their own ``__call__``.
``decoder_for(model)`` keeps one decoder per model, so a model is traced once, not once
per reply; ``MLX_TFM_COMPILED_DECODE=0`` turns the route off (every step then goes
through ``model(...)``, as before).
"""

from __future__ import annotations

import os
import weakref
from functools import partial

import mlx.core as mx

from ..cpu import int8_activations, on_cpu
from .attention import Attention, attention
from .layers import MLP
from .transformer import Model, TransformerBlock


def block_takes(layer) -> bool:
    """Whether one block is the plain pre-norm attention + dense MLP form the pieces cover
    (not, say, a pipeline rank's stand-in for the blocks of another rank)."""
    if type(layer) is not TransformerBlock:
        return False
    plain_block = (layer.sublayers == "mixer+mlp" and layer.placement == "pre" and layer.residual
                   and layer.residual_scale == 1.0 and not layer.per_layer_act and not layer.scales_output
                   and not layer.experts_beside and "mamba" not in layer and "cross_attn" not in layer)
    if not plain_block or layer.mixer_name != "self_attn" or type(layer.mlp) is not MLP:
        return False
    mixer = layer.mixer
    return type(mixer) is Attention and not mixer.output_gate and not mixer.query_scale[0] \
        and not mixer.reads_shared_kv


class CompiledDecoder:
    """``model(token (B, 1), cache=cache)`` for one position, each layer's cache-free pieces
    compiled (traced on first use, once per state of the CPU switches)."""

    def __init__(self, model):
        # weakly: the registry below must not keep a model alive that its user dropped
        self._model = weakref.ref(model)
        self._pieces: dict[tuple[bool, bool], list] = {}

    @staticmethod
    def takes(model) -> bool:
        """Whether ``model`` is a decoder whose every block the compiled pieces cover and
        whose embeddings need nothing but the lookup (and a scale)."""
        if type(model) is not Model:
            return False
        args = model.args
        if args.kind != "decoder" or args.position_embedding not in ("rope", "none") or args.type_vocab_size:
            return False
        if args.embedding_norm or args.hidden_size_per_layer_input or args.num_kv_shared_layers:
            return False
        if args.relative_attention_num_buckets or not args.own_embeddings or args.cross_attention:
            return False
        if any(chunk is not None for chunk in model.model.chunks):
            return False
        return all(block_takes(layer) for layer in model.layers)

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        """Token ids (B, 1) -> logits (B, 1, vocab_size), ``cache`` advanced by one."""
        model = self._model()
        stack = model.model
        h = stack.embed_tokens(inputs)  # (B, 1, D)
        if stack.args.embedding_scale is not None:
            h = h * mx.array(stack.args.embedding_scale, dtype=h.dtype)
        # every layer's mask and position before any cache moves, as the plain call has them;
        # the positions as arrays: one trace serves every step
        masks = [layer_cache.make_mask(1, window) for layer_cache, window in zip(cache, stack.windows)]
        offsets = [mx.array(layer_cache.offset) for layer_cache in cache]
        first, *joins, last = self._pieces_now()
        queries, keys, values = first(h, offsets[0])
        for i, (layer, layer_cache, mask) in enumerate(zip(stack.layers, cache, masks)):
            mixer = layer.self_attn
            keys, values = layer_cache.update_and_fetch(keys, values)
            attended = attention(queries, keys, values, mixer.scale, mask, mixer.softcap, mixer.get("sinks"))
            if i < len(joins):
                h, queries, keys, values = joins[i](h, attended, offsets[i + 1])
        h = last(h, attended)
        if stack.args.final_norm:
            h = stack.norm(h)
        return model.head(h)

    def _pieces_now(self) -> list:
        """The compiled pieces for the CPU switches' current state (the routes a trace took,
        int8 activations or not, are baked into it): the first layer's heads, one join per
        pair of neighbouring layers, the last layer's finish."""
        routes = (on_cpu(), int8_activations())
        if routes not in self._pieces:
            self._pieces[routes] = compiled_pieces(self._model().layers)
        return self._pieces[routes]


def block_heads(layer, x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The block's input norm, q/k/v products and RoPE: (B, 1, D) -> queries, keys, values
    (B, heads, 1, head_dim)."""
    return tuple(layer.self_attn.heads(layer.input_layernorm(x), offset))


def block_finish(layer, x: mx.array, attended: mx.array) -> mx.array:
    """The block's residual stream x (B, 1, D) after attention's output (B, n_heads, 1,
    head_dim): o_proj, its residual, the post-attention norm, the MLP and its residual."""
    h = x + layer.self_attn.output(attended)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def compiled_pieces(layers: list) -> list:
    """``[heads of layer 0, join 0-1, ..., join (N-2)-(N-1), finish of layer N-1]``, where a
    join finishes one block and starts the next (one compiled call instead of two). Each
    is compiled with its blocks' arrays as implicit inputs: read at every call, so updated
    weights are used, never baked in."""

    def join(before, after):
        def finish_then_heads(x: mx.array, attended: mx.array, offset: mx.array):
            h = block_finish(before, x, attended)
            return (h, *block_heads(after, h, offset))

        return mx.compile(finish_then_heads, inputs=[before, after])

    first = mx.compile(partial(block_heads, layers[0]), inputs=[layers[0]])
    last = mx.compile(partial(block_finish, layers[-1]), inputs=[layers[-1]])
    return [first, *(join(a, b) for a, b in zip(layers, layers[1:])), last]


ENV_VAR = "MLX_TFM_COMPILED_DECODE"
_enabled = os.environ.get(ENV_VAR, "1") != "0"
# id(model) -> (the ids of its modules when its decoder was made, the decoder)
_DECODERS: dict[int, tuple[tuple[int, ...], CompiledDecoder]] = {}


def decoder_for(model) -> CompiledDecoder | None:
    """The model's compiled decoder, made once per model and again when its modules were
    swapped since (adapters applied or fused, CPU layers specialized: a trace holds the
    modules it ran through); None where the route is off or does not take the model."""
    if not _enabled or not CompiledDecoder.takes(model):
        return None
    modules = tuple(id(module) for module in model.modules())
    held = _DECODERS.get(id(model))
    if held is None:
        weakref.finalize(model, _DECODERS.pop, id(model), None)
    if held is None or held[0] != modules:
        held = _DECODERS[id(model)] = (modules, CompiledDecoder(model))
    return held[1]
