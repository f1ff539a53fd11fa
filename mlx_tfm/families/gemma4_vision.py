"""Gemma 4 (``gemma4``) with its vision tower: the language model as gemma4.py reads it,
plus ``vision`` (``VisionArgs`` with tower_kind "gemma4", the tower's fields in
``tower_fields``: model/gemma4_vision.py). The audio tower is dropped: no audio input is
read here. A checkpoint without a ``vision_config`` is its language model alone.

On disk as transformers 4 names it and mlx-lm's gemma4 reads it (``language_model.model.*``,
``language_model.lm_head.*``, ``vision_tower.*``, ``embed_vision.*``), which are our names;
transformers 5's in-memory ``model.*`` names are renamed there.
"""

from __future__ import annotations

from ..model.config import ModelArgs
from .common import COMMON_DROPS, Architecture, activation
from .decoders import gemma3_layout
from .gemma4 import ROUTERS, drop_shared_layers_kv, experts_layout, gemma4_args

# transformers' Gemma4VisionConfig defaults for the keys a hub config leaves out
GEMMA4_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                    num_key_value_heads=12, head_dim=64, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                    pooling_kernel_size=3, patch_size=16, position_embedding_size=10240, use_clipped_linears=False,
                    standardize=False)


def gemma4_vision_args(config: dict) -> dict:
    """The language model's fields, plus ``vision`` when the checkpoint has a tower."""
    args = gemma4_args(config)
    if config.get("vision_config") is None:
        return args
    text = config.get("text_config") or {}  # gemma4_args refuses use_bidirectional_attention ("vision" too)
    v = {**GEMMA4_TOWER, **{k: val for k, val in config["vision_config"].items() if val is not None}}
    fields = {name: v[name] for name in GEMMA4_TOWER if name != "hidden_activation"}
    fields.update(hidden_act=activation(v["hidden_activation"]), pad_token_id=text.get("pad_token_id", 0),
                  rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 100.0))
    return {**args, "vision": {"tower_kind": "gemma4", "tower_fields": fields, "patch_size": v["patch_size"],
                               "image_token_id": config.get("image_token_id", 258880)}}


def gemma4_vision_layout(weights: dict) -> dict:
    """transformers 5's names -> the saved ones (the tower and embedder without ``model.``)."""
    out = {}
    for name, tensor in gemma3_layout(weights).items():
        if name.startswith(("model.vision_tower.", "model.embed_vision.")):
            name = name.removeprefix("model.")
        out[name] = tensor
    return out


def gemma4_vision_rewrite(weights: dict, args: ModelArgs) -> dict:
    """The language model's unused shared-layer keys and values dropped (the tower's layers
    are not the language model's); a tied head's copy dropped; without a tower, the
    language model's names as the text-only model has them."""
    language = {name: w for name, w in weights.items() if name.startswith("language_model.")}
    kept = {**drop_shared_layers_kv(language, args),
            **{name: w for name, w in weights.items() if not name.startswith("language_model.")}}
    if args.tie_word_embeddings:
        kept.pop("language_model.lm_head.weight", None)
    if args.vision is not None:
        return kept
    return {name.removeprefix("language_model."): w for name, w in kept.items()
            if name.startswith("language_model.")}


AUDIO = (r"(model\.)?audio_tower\..*", r"(model\.)?embed_audio\..*")

GEMMA4_VISION_FAMILIES: dict[str, Architecture] = {
    # replaces gemma4.py's text-only reading of gemma4 (families/__init__.py puts it after)
    "gemma4": Architecture(args=gemma4_vision_args, drops=COMMON_DROPS + AUDIO, layout=gemma4_vision_layout,
                           rewrite=gemma4_vision_rewrite, experts=experts_layout, routers=ROUTERS,
                           unquantized=r"(?:model\.)?(?:vision_tower|embed_vision)\..*"),
}
