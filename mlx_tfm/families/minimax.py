"""MiniMax-Text-01 (``minimax``): lightning attention (``model/lightning.py``) on most
layers, softmax attention with RoPE on the others (every 8th in the released model), a
Mixtral-style mixture of experts in every layer, and MiniMax's residuals: each sublayer's
residual is its *normed* input, weighted, ``alpha * norm(x) + beta * sublayer(norm(x))``,
with one (alpha, beta) for the lightning layers, one for the attention layers and one for
the feed-forward (norm_placement "normed_residual").

The checkpoint lays its experts out as Mixtral's (``block_sparse_moe.experts.N.w1/w2/w3``);
the lightning layers' decay tables (``slope_rate``, ``query_decay``, ``key_decay``,
``diagonal_decay``) are derived from the layer's position, so they are dropped and
recomputed.
"""

from __future__ import annotations

from ..errors import UserError
from .common import COMMON_DROPS, Architecture
from .experts import MIXTRAL_RENAMES, ROUTERS, mixtral_args, mixtral_layout

MINIMAX_LAYER_KINDS = {"linear_attention": "lightning_attention", "full_attention": "full_attention"}
DECAY_TABLES = r".*\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)"


def minimax_layer_types(config: dict) -> list[str]:
    """Per layer "lightning_attention" or "full_attention" (transformers' default when the
    config lists none: layers 1, 3, 5... lightning)."""
    kinds = config.get("layer_types") or [
        "full_attention" if (i + 1) % 2 else "linear_attention" for i in range(config["num_hidden_layers"])]
    unknown = sorted(set(kinds) - set(MINIMAX_LAYER_KINDS))
    if unknown:
        raise UserError(f"minimax layer type {unknown[0]!r} is not supported (linear_attention, full_attention)")
    return [MINIMAX_LAYER_KINDS[kind] for kind in kinds]


def minimax_args(config: dict) -> dict:
    return {
        **mixtral_args(config),
        "layer_types": minimax_layer_types(config),
        "norm_placement": "normed_residual",
        "mixer_residual_factors": {
            "lightning_attention": (config.get("linear_attn_alpha_factor", 1), config.get("linear_attn_beta_factor", 1)),
            "full_attention": (config.get("full_attn_alpha_factor", 1), config.get("full_attn_beta_factor", 1)),
        },
        "mlp_residual_factors": (config.get("mlp_alpha_factor", 1), config.get("mlp_beta_factor", 1)),
    }


MINIMAX: dict[str, Architecture] = {
    "minimax": Architecture(args=minimax_args, renames=MIXTRAL_RENAMES, drops=COMMON_DROPS + (DECAY_TABLES,),
                            experts=mixtral_layout, routers=ROUTERS),
}
