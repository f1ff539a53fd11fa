"""How each Hugging Face ``model_type`` maps onto the one model: a declarative table.

An entry says which ``ModelArgs`` fields the checkpoint's config.json implies, and how its
tensor names map onto ours (``None`` drops a tensor). Everything else is shared.

Two layouts matter for a checkpoint:
- the *on-disk* layout the converter writes: the one mlx-lm writes for that model_type, so
  mlx-lm loads our folders (for most families that is the Hugging Face layout itself; gpt2
  gets its Conv1D weights transposed and a ``model.`` prefix, as mlx-lm's gpt2 stores it;
  phi3 keeps its fused ``qkv_proj`` / ``gate_up_proj``). ``Architecture.layout`` turns a
  Hugging Face checkpoint into it and leaves an on-disk one unchanged.
- *our* module names: ``renames`` and ``rewrite`` turn the on-disk layout into them when
  the model is loaded. Fused tensors are split by rows, which also splits quantized
  weights, their scales and biases, so quantized folders load the same way.
"""

from __future__ import annotations

import difflib
import re

from ..errors import UserError
from ..model.config import ModelArgs
from .common import Architecture
from .convolutions import CONVOLUTIONS
from .decoders import DECODERS
from .encoders import ENCODERS
from .experts import MIXTURES
from .gemma4 import GEMMA4
from .gemma4_vision import GEMMA4_VISION_FAMILIES
from .hybrids import HYBRIDS
from .kimi import KIMI
from .latent import LATENT
from .lfm2_vl import LFM2_VL_FAMILIES
from .llama4 import LLAMA4
from .minimax import MINIMAX
from .more_decoders import MORE_DECODERS
from .more_mixtures import MORE_MIXTURES
from .not_yet import NOT_YET
from .pixtral import PIXTRAL_FAMILIES
from .qwen3_5_vl import QWEN3_5_VL
from .qwen_vl import QWEN_VL
from .state_space import STATE_SPACE
from .vision import VISION_LANGUAGE


# The table: every model_type we build, each family kind in its own file.
ARCHITECTURES: dict[str, Architecture] = {
    **DECODERS, **MIXTURES, **ENCODERS, **MORE_DECODERS, **MORE_MIXTURES, **GEMMA4, **LLAMA4,
    **HYBRIDS, **STATE_SPACE, **CONVOLUTIONS, **LATENT, **KIMI, **MINIMAX,
    **VISION_LANGUAGE,  # image-text models (llava, idefics3, smolvlm, gemma3): after DECODERS' text-only gemma3
    **QWEN_VL,  # Qwen2-VL / Qwen2.5-VL: the language model (qwen_vl.py; the tower beside it)
    **PIXTRAL_FAMILIES,  # mistral3 with its Pixtral tower: after MORE_DECODERS' text-only mistral3
    **LFM2_VL_FAMILIES,  # LFM2-VL: LFM2 with SigLIP2's NaFlex tower
    **GEMMA4_VISION_FAMILIES,  # gemma4 with its vision tower: after GEMMA4's text-only gemma4
    **QWEN3_5_VL,  # qwen3_5, qwen3_5_moe with their tower: after HYBRIDS' language models alone
}


def architecture_for(config: dict) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(unknown_model_type_message(model_type))
    return ARCHITECTURES[model_type]


def unknown_model_type_message(model_type) -> str:
    """One line: the type (with what is missing, for a family we know of), the supported
    families nearest in spelling (a typo, or a sibling such as qwen3 for qwen3_vl), then
    every supported one."""
    known = f" (not built yet: {NOT_YET[model_type][1]})" if model_type in NOT_YET else ""
    nearest = difflib.get_close_matches(str(model_type), ARCHITECTURES, n=3, cutoff=0.6)
    closest = f"closest: {', '.join(nearest)}; " if nearest else ""
    return f"unknown model_type {model_type!r}{known}; {closest}supported: {', '.join(sorted(ARCHITECTURES))}"


def model_args_from_config(config: dict) -> ModelArgs:
    """config.json (Hugging Face or mlx-lm) -> ModelArgs."""
    return ModelArgs.from_dict(architecture_for(config).args(config))


def on_disk_layout(config: dict, weights: dict) -> dict:
    """A checkpoint in its source layout -> the layout the converter writes (mlx-lm's)."""
    arch = architecture_for(config)
    drops = [re.compile(p) for p in arch.drops]
    weights = {k: v for k, v in weights.items() if not any(p.fullmatch(k) for p in drops)}
    weights = arch.layout(weights) if arch.layout is not None else weights
    return arch.experts(weights, config) if arch.experts is not None else weights


def map_weights(config: dict, args: ModelArgs, weights: dict) -> dict:
    """Rename, drop and rewrite a checkpoint's tensors into our names. Idempotent, so
    folders we wrote ourselves pass through unchanged."""
    arch = architecture_for(config)
    mapped = {}
    for name, tensor in on_disk_layout(config, weights).items():
        for pattern, replacement in arch.renames:
            if re.fullmatch(pattern, name):
                name = None if replacement is None else re.sub(pattern, replacement, name)
                break
        if name is not None:
            mapped[name] = tensor
    if args.tie_word_embeddings:
        mapped.pop("lm_head.weight", None)
    if arch.rewrite is not None:
        mapped = arch.rewrite(mapped, args)
    return mapped
