"""Vision-language families (LLaVA 1.5, LLaVA-NeXT, Idefics3, SmolVLM, Gemma 3): config.json -> the
language model's ``ModelArgs`` fields plus ``vision``, the ``VisionArgs`` fields
(model/vision_args.py: the tower's own ``ModelArgs`` fields, kind "encoder" fed patch
embeddings, its patch embedding and the projector); and the renames from their
checkpoints onto ``VisionLanguageModel``'s names.

The on-disk layout the converter writes is the one transformers saves (``saved_layout``:
``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*`` for LLaVA and
Gemma 3, so mlx-lm reads their language model; ``model.text_model.*``, ``model.vision_model.*``,
``model.connector.*`` for Idefics3); the renames read these and transformers 5's in-memory names.
"""

from __future__ import annotations

import re

from ..errors import UserError
from ..model.config import ModelArgs
from .common import COMMON_DROPS, Architecture, activation
from .decoders import DECODERS, saved_language_model_name
from .mlx_vlm import MLX_VLM_RENAMES, channels_first_patches
from .more_decoders import MORE_DECODERS

# transformers' defaults for the keys hub configs leave out, by tower
CLIP_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5, num_channels=3)
SIGLIP_TOWER = dict(CLIP_TOWER, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
IDEFICS3_TOWER = dict(SIGLIP_TOWER, hidden_size=1152, num_attention_heads=16, patch_size=32)


def tower_args(vision: dict, defaults: dict, layers: int | None = None, clip: bool = False) -> dict:
    """A ViT's ``VisionArgs`` fields: the tower (kind "encoder" over patch embeddings,
    learned positions, LayerNorm, an ungated GELU MLP, biases everywhere) and its patch
    embedding. CLIP adds its class token and pre-norm (no patch bias) and ends without the
    post-norm (LLaVA reads a layer's hidden states), SigLIP ends with it. ``layers``: how
    many layers to run (fewer than the checkpoint has when a family reads an earlier one)."""
    v = {**defaults, **{k: val for k, val in vision.items() if val is not None}}
    patches = (v["image_size"] // v["patch_size"]) ** 2
    tower = {
        "model_type": v.get("model_type", "vision_tower"), "kind": "encoder", "hidden_size": v["hidden_size"],
        "intermediate_size": v["intermediate_size"], "num_attention_heads": v["num_attention_heads"],
        "num_hidden_layers": v["num_hidden_layers"] if layers is None else layers,
        "norm_type": "layernorm", "norm_eps": v["layer_norm_eps"], "hidden_act": activation(v["hidden_act"]),
        "ffn_gated": False, "mlp_bias": True, "attention_bias": True, "attention_out_bias": True,
        "position_embedding": "learned", "max_position_embeddings": patches + int(clip), "own_embeddings": False,
        "embedding_norm": clip, "final_norm": not clip, "tie_word_embeddings": False, "vocab_size": 1,
    }
    return {"tower": tower, "image_size": v["image_size"], "patch_size": v["patch_size"],
            "num_channels": v["num_channels"], "class_token": clip, "patch_bias": not clip}


TEXT_FAMILIES = {**DECODERS, **MORE_DECODERS}


def text_args(config: dict, default_type: str) -> dict:
    """The language model's fields, by its own family's table entry (``text_config``)."""
    text = {"model_type": default_type, **(config.get("text_config") or {})}
    if text["model_type"] not in TEXT_FAMILIES:
        raise UserError(f"a {config['model_type']} model with a {text['model_type']!r} language model is not supported")
    args = TEXT_FAMILIES[text["model_type"]].args(text)
    if "tie_word_embeddings" in config:  # the image-text model's own setting is what ties
        args["tie_word_embeddings"] = config["tie_word_embeddings"]
    return args


def llava_feature_layers(config: dict, n_layers: int) -> int:
    """How many tower layers LLaVA runs: hidden_states[k] is the output after k layers
    (index 0 the embeddings), negative k counting from the end."""
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise UserError("LLaVA with several vision_feature_layer entries is not supported")
    return layer if layer >= 0 else n_layers + 1 + layer


def llava_args(config: dict) -> dict:
    vision = config.get("vision_config") or {}
    n_layers = vision.get("num_hidden_layers", CLIP_TOWER["num_hidden_layers"])
    return {**text_args(config, "llama"), "model_type": config["model_type"], "vision": {
        **tower_args(vision, CLIP_TOWER, llava_feature_layers(config, n_layers), clip=True),
        "projector": "mlp", "projector_act": activation(config.get("projector_hidden_act", "gelu")),
        "projector_bias": config.get("multimodal_projector_bias", True),
        "vision_feature_select": config.get("vision_feature_select_strategy", "default"),
        "image_token_id": config.get("image_token_index", config.get("image_token_id", 32000)),
    }}


# transformers' LlavaNextConfig default: the (height, width) resolutions an image is fitted into
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def llava_next_args(config: dict) -> dict:
    """LLaVA-NeXT: LLaVA 1.5's tower and projector over every view of an "anyres" image,
    the views packed back into the image's grid (model/anyres.py). The packing cuts the
    features into a square grid per view, so the class token must go (strategy "default":
    transformers fails on "full" with CLIP's class token too)."""
    args = llava_args(config)
    if args["vision"]["vision_feature_select"] != "default":
        raise UserError("LLaVA-NeXT with vision_feature_select_strategy 'full' keeps CLIP's class token, which "
                        "its packed image grid has no place for: only 'default' is supported")
    pinpoints = config.get("image_grid_pinpoints") or LLAVA_NEXT_PINPOINTS
    args["vision"]["image_grid_pinpoints"] = [list(p) for p in pinpoints]
    return args


def idefics3_args(config: dict) -> dict:
    """Idefics3 and SmolVLM: a SigLIP-like tower over each tile, pixel shuffle, one linear map."""
    return {**text_args(config, "llama"), "model_type": config["model_type"], "vision": {
        **tower_args(config.get("vision_config") or {}, IDEFICS3_TOWER),
        "projector": "pixel_shuffle", "projector_scale": config.get("scale_factor", 2),
        "image_token_id": config.get("image_token_id", 128257),
    }}


def gemma3_vision_args(config: dict) -> dict:
    """Gemma 3 image-text: SigLIP, average pooling to ``mm_tokens_per_image``, and the
    image's tokens attending to each other both ways."""
    return {**text_args(config, "gemma3_text"), "model_type": config["model_type"], "vision": {
        **tower_args(config.get("vision_config") or {}, SIGLIP_TOWER),
        "projector": "average_pool", "tokens_per_image": config.get("mm_tokens_per_image", 256),
        "image_token_id": config.get("image_token_index", config.get("image_token_id", 262144)),
        "image_attention": "bidirectional",
    }}


# Any of the prefixes a tower's tensors come under, then the part after it
TOWER = r"(?:model\.)?(?:vision_tower|vision_model)\.(?:vision_model\.)?"
LAYER = TOWER + r"encoder\.layers\.(\d+)\."
ours = "vision_tower.encoder."
VISION_RENAMES = MLX_VLM_RENAMES + (
    (TOWER + r"embeddings\.position_embedding\.(.*)", ours + r"embed_positions.\1"),
    (TOWER + r"embeddings\.(.*)", r"vision_tower.embeddings.\1"),
    (TOWER + r"pre_layrnorm\.(.*)", ours + r"embed_norm.\1"),
    (TOWER + r"post_layernorm\.(.*)", ours + r"norm.\1"),
    (TOWER + r"head\..*", None),  # SigLIP's pooling head: no family here reads it
    (LAYER + r"self_attn\.out_proj\.(.*)", ours + r"layers.\1.self_attn.o_proj.\2"),
    (LAYER + r"self_attn\.(.*)", ours + r"layers.\1.self_attn.\2"),
    (LAYER + r"layer_norm1\.(.*)", ours + r"layers.\1.input_layernorm.\2"),
    (LAYER + r"layer_norm2\.(.*)", ours + r"layers.\1.post_attention_layernorm.\2"),
    (LAYER + r"mlp\.fc1\.(.*)", ours + r"layers.\1.mlp.up_proj.\2"),
    (LAYER + r"mlp\.fc2\.(.*)", ours + r"layers.\1.mlp.down_proj.\2"),
    (r"(?:model\.)?image_newline", "image_newline"),  # LLaVA-NeXT's row end
    (r"(?:model\.)?(?:multi_modal_projector|connector)\.(.*)", r"multi_modal_projector.\1"),
    (r"(?:language_model\.)?lm_head\.(.*)", r"language_model.lm_head.\1"),
    (r"(?:language_model\.model|model\.language_model|model\.text_model)\.(.*)", r"language_model.model.\1"),
)


def unused_tower_tensors(weights: dict, args: ModelArgs) -> dict:
    """Without the tensors the model does not run: the tower's layers after the one a
    family reads (LLaVA), its post-norm where it ends without it, a tied head's copy."""
    vision = (args.vision or {}).get("tower", {})
    n_layers = vision.get("num_hidden_layers", 0)
    pattern = re.compile(r"vision_tower\.encoder\.layers\.(\d+)\..*")

    def used(name: str) -> bool:
        match = pattern.fullmatch(name)
        if match is not None:
            return int(match.group(1)) < n_layers
        return vision.get("final_norm", True) or not name.startswith("vision_tower.encoder.norm.")

    kept = channels_first_patches({name: tensor for name, tensor in weights.items() if used(name)}, args)
    if args.tie_word_embeddings:  # mlx-vlm's -q writes a tied head's copy quantized: scales, biases too
        kept = {name: tensor for name, tensor in kept.items() if not name.startswith("language_model.lm_head.")}
    return kept


# The on-disk paths of the tower and the projector, which -q keeps in float unless asked
VISION_PATHS = r"(?:model\.)?(?:vision_tower|vision_model|multi_modal_projector|connector)\..*"


def saved_layout(weights: dict) -> dict:
    """LLaVA's and Gemma 3's tensors as transformers saves them (and mlx-lm reads the
    language model): transformers 5's in-memory ``model.language_model.*``, ``lm_head.*``,
    ``model.vision_tower.*``, ``model.multi_modal_projector.*`` renamed; saved names pass."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) or name == "model.image_newline":
            name = name.removeprefix("model.")
        out[saved_language_model_name(name)] = tensor
    return out


def vision_architecture(args, layout=None) -> Architecture:
    return Architecture(args=args, renames=VISION_RENAMES, drops=COMMON_DROPS, rewrite=unused_tower_tensors,
                        layout=layout, unquantized=VISION_PATHS)


VISION_LANGUAGE: dict[str, Architecture] = {
    "llava": vision_architecture(llava_args, saved_layout),  # LLaVA 1.5
    "llava_next": vision_architecture(llava_next_args, saved_layout),  # LLaVA-NeXT (1.6): anyres views
    "idefics3": vision_architecture(idefics3_args),
    "smolvlm": vision_architecture(idefics3_args),
    "gemma3": vision_architecture(gemma3_vision_args, saved_layout),  # the image-text model; gemma3_text is text only
}
