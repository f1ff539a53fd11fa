"""Parameters and cache bytes per layer kind (attention, MLA's latents, LFM2's short
convolutions, Gated DeltaNet, Mamba, any recurrent mixer of ``mlx_tfm.model.mixers``).

An attention layer's cache grows with every position it holds (``architecture.
kv_cache_bytes``); a recurrent layer's is a fixed-size state, the same at position 10 as
at 100,000. Its size is measured, not derived from a formula per mixer: the layer's
mixer reads one position into a fresh ``make_cache()`` and the state's bytes are
counted, so a new recurrent kind is reported with no change here.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..model.mixers import ATTENTION_TYPES, mixer_kind
from .architecture import kv_position_bytes, positions_held
from .parts import Part


def state_bytes(mixer: nn.Module, hidden_size: int) -> int:
    """Bytes of one sequence's state in a recurrent ``mixer`` (in its weights' dtype)."""
    dtype = next((a.dtype for _, a in tree_flatten(mixer.parameters()) if mx.issubdtype(a.dtype, mx.floating)),
                 mx.float32)
    cache = mixer.make_cache()
    mixer(mx.zeros((1, 1, hidden_size), dtype), None, cache)  # (B, L, D): one position
    mx.eval(cache.state)
    return cache.nbytes


def layer_kinds(model, parts: list[Part], context: int, dtype_bytes: int = 2) -> list[dict]:
    """Per layer type, in order of first appearance: how many layers, their parameters
    (the mixers' alone, and the whole blocks'), and one sequence's cache bytes per layer:
    a recurrent state (fixed), or keys and values at ``context`` positions
    (``dtype_bytes`` a number, as float16: 2)."""
    args = model.args
    held = positions_held(args, context)
    kv_position = kv_position_bytes(args, dtype_bytes)  # keys and values, or MLA's latent and rotary key
    rows = []
    for kind in dict.fromkeys(args.layer_types):
        layers = [i for i, t in enumerate(args.layer_types) if t == kind]
        attribute = mixer_kind(kind).attribute
        in_layers = [p for p in parts if p.layer in layers]
        recurrent = kind not in ATTENTION_TYPES
        beside = state_beside_bytes(model, layers[0]) if not recurrent else 0
        per_layer = (state_bytes(model.layers[layers[0]].mixer, args.hidden_size) if recurrent
                     else max(held[i] for i in layers) * kv_position + beside)
        rows.append({
            "kind": kind, "layers": len(layers), "recurrent": recurrent,
            "mixer_parameters": sum(p.parameters for p in in_layers if in_mixer(p.name_in_block, attribute)),
            "block_parameters": sum(p.parameters for p in in_layers),
            "cache_bytes_per_layer": per_layer,
            "state_bytes_beside_attention": beside,
        })
    return rows


def in_mixer(name_in_block: str, attribute: str) -> bool:
    """Whether a block's part belongs to its mixer: the mixer's own arrays (Mamba's
    ``A_log``, ``D``, DeltaNet's ``dt_bias``) or a module inside it."""
    return name_in_block == attribute or name_in_block.startswith(attribute + ".")


def state_beside_bytes(model, layer: int) -> int:
    """Bytes of the fixed state of the Mamba-2 mixer an attention layer has beside it
    (Falcon-H1; 0 without one), which its cache keeps with the keys and values."""
    if not model.args.mamba_beside_attention:
        return 0
    return state_bytes(model.layers[layer].mamba, model.args.hidden_size)


__all__ = ["layer_kinds", "state_bytes"]
