"""Which module mixes positions in each layer type: the one table a new layer kind joins.

A block is a token mixer and a feed-forward. The mixer is chosen by the layer's entry in
``ModelArgs.layer_types``: attention (full or sliding) keeps keys and values in a KV
cache; a recurrent kind (linear attention, Mamba, short convolutions) keeps a fixed-size
state, and its module says which by ``make_cache()`` (a ``StateCache``, see
``state_cache.py``). Every mixer is called as ``mixer(x (B, L, D), mask, cache) -> (B, L, D)``;
recurrent ones ignore ``mask``, since they read positions in order.

``attribute`` is the block's attribute and so the checkpoint name of the mixer's weights
(``model.layers.N.self_attn.q_proj``, ``model.layers.N.linear_attn.in_proj_qkvz``...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.nn as nn

from .attention import Attention
from .config import ModelArgs
from .deltanet import GatedDeltaNet
from .kimi_delta import KimiDeltaAttention
from .latent_attention import LatentAttention
from .lightning import LightningAttention
from .mamba import Mamba1Mixer, Mamba2Mixer
from .short_conv import ShortConv

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class MixerKind:
    attribute: str  # the block's attribute holding the mixer: its checkpoint name
    build: Callable[[ModelArgs, int], nn.Module]  # (args, layer_idx) -> the mixer


def attention_mixer(args: ModelArgs, layer_idx: int) -> nn.Module:
    if args.kv_lora_rank:  # DeepSeek's multi-head latent attention: a compressed KV cache
        return LatentAttention(args, layer_idx)
    return Attention(args, layer_idx)


MIXERS: dict[str, MixerKind] = {
    "full_attention": MixerKind("self_attn", attention_mixer),
    "sliding_attention": MixerKind("self_attn", attention_mixer),
    "mamba": MixerKind("mamba", Mamba2Mixer),  # Mamba-2's SSD (model/mamba.py)
    "mamba1": MixerKind("mamba", Mamba1Mixer),  # Mamba-1's selective scan (model/mamba.py)
    "conv": MixerKind("conv", ShortConv),  # LFM2's gated short convolution (short_conv.py)
    "linear_attention": MixerKind("linear_attn", GatedDeltaNet),
    "chunked_attention": MixerKind("self_attn", attention_mixer),  # Llama 4 (local_attention.py)
    # Kimi Linear's KDA: the delta rule with a decay per key channel (model/kimi_delta.py)
    "kimi_delta_attention": MixerKind("self_attn", KimiDeltaAttention),
    # MiniMax-Text-01's lightning attention: linear attention, a fixed decay per head (model/lightning.py)
    "lightning_attention": MixerKind("self_attn", LightningAttention),
}


def mixer_kind(layer_type: str) -> MixerKind:
    if layer_type not in MIXERS:
        raise ValueError(f"unknown layer type {layer_type!r} ({', '.join(MIXERS)})")
    return MIXERS[layer_type]
