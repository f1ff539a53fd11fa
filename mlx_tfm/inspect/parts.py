"""Where a model's parameters and bytes go, part by part, as the seed counts them.

A *part* is a module that holds arrays, named by its path: ``model.embed_tokens``,
``model.layers.3.self_attn.q_proj``, ``model.layers.3.mlp.experts.gate_proj``. Its *kind*
is read from the first name under the model or the block (``self_attn``: attention,
``mlp``: FFN, ...). A name the table does not know is reported as it is, of kind "norm"
(a norm layer) or "other", so a new part type (experts, a router) needs nothing here.

Parameters are the weights a part stands for: a quantized matrix counts ``out * in`` (its
packed uint32 words, scales and biases are how it is stored, not more weights); its bytes
are everything it holds. A tied head *is* the embedding matrix: counted once, there.

The seed's budget for one block (MHA, a two-matrix FFN with d_ff = 4d, no biases):
attention 4d² (W^Q, W^K, W^V, W^O), FFN 8d² (W_1, W_2): the FFN is 2/3 of the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..model.layers import RMSNorm
from ..model.mixers import ATTENTION_TYPES, MIXERS

# Recurrent token mixers (LFM2's "conv", ...) by their block attribute, where it is their own.
KINDS = {**{kind.attribute: "recurrent" for name, kind in MIXERS.items() if name not in ATTENTION_TYPES},
         "embed_tokens": "embedding", "embed_positions": "positions", "self_attn": "attention", "mlp": "ffn",
         "lm_head": "head"}
# Recurrent mixers that checkpoints name ``self_attn`` (Kimi's KDA, MiniMax's lightning
# attention) are told by their module's type.
RECURRENT_MIXERS = tuple(kind.build for name, kind in MIXERS.items()
                         if name not in ATTENTION_TYPES and isinstance(kind.build, type))
NORMS = (RMSNorm, nn.LayerNorm)
BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
# What a quantized module holds beside its packed ``weight`` (MLX's affine layout).
QUANTIZATION_ARRAYS = ("scales", "biases")
TEXTBOOK_FFN_SHARE = 2 / 3  # 8d² / (4d² + 8d²)


@dataclass(frozen=True)
class Part:
    name: str  # the module's path
    kind: str  # embedding | positions | attention | recurrent | ffn | norm | head | other
    layer: int | None  # the block it belongs to
    parameters: int
    matrix_parameters: int  # of these, the ones in matrices (what a token is multiplied by)
    bytes: int  # in memory, as stored
    stored_as: str  # "float32", "4-bit, group 64"

    @property
    def name_in_block(self) -> str:
        """``self_attn.q_proj`` for ``model.layers.3.self_attn.q_proj``; top-level names as they are."""
        match = BLOCK.fullmatch(self.name)
        return match.group(2) if match else self.name


def arrays_by_module(model: nn.Module) -> dict[str, dict[str, mx.array]]:
    """Each module's own arrays (not its children's), by module path, in the model's order."""
    grouped: dict[str, dict[str, mx.array]] = {}
    for name, array in tree_flatten(model.parameters()):
        path, _, key = name.rpartition(".")
        grouped.setdefault(path, {})[key] = array
    return grouped


def is_quantized(arrays: dict[str, mx.array]) -> bool:
    return "scales" in arrays


def logical_size(module: nn.Module, arrays: dict[str, mx.array], key: str) -> int:
    """How many weights one array stands for: a quantized module's packed ``weight`` holds
    32 // bits of them per uint32 word; its scales and biases stand for none."""
    if not is_quantized(arrays):
        return arrays[key].size
    if key == "weight":
        return arrays[key].size * 32 // module.bits
    return 0 if key in QUANTIZATION_ARRAYS else arrays[key].size


def stored_as(module: nn.Module, arrays: dict[str, mx.array]) -> str:
    if is_quantized(arrays):
        return f"{module.bits}-bit, group {module.group_size}"
    return str(next(iter(arrays.values())).dtype).removeprefix("mlx.core.")


def kind_of(path: str, module: nn.Module, modules: dict[str, nn.Module] | None = None) -> str:
    match = BLOCK.fullmatch(path)
    first = (match.group(2) if match else path.removeprefix("model.")).split(".")[0]
    if match and isinstance((modules or {}).get(f"model.layers.{match.group(1)}.{first}"), RECURRENT_MIXERS):
        return "recurrent"
    return KINDS.get(first) or ("norm" if isinstance(module, NORMS) else "other")


def model_parts(model: nn.Module) -> list[Part]:
    """Every module that holds arrays, with its logical parameter count and its bytes."""
    modules = dict(model.named_modules())
    parts = []
    for path, arrays in arrays_by_module(model).items():
        module = modules[path]
        sizes = {key: logical_size(module, arrays, key) for key in arrays}
        match = BLOCK.fullmatch(path)
        parts.append(Part(
            name=path,
            kind=kind_of(path, module, modules),
            layer=int(match.group(1)) if match else None,
            parameters=sum(sizes.values()),
            matrix_parameters=sum(n for key, n in sizes.items() if arrays[key].ndim >= 2),
            bytes=sum(array.nbytes for array in arrays.values()),
            stored_as=stored_as(module, arrays),
        ))
    return parts


@dataclass(frozen=True)
class PartRow:
    """A row of the parameter table: a part outside the blocks, or one part name summed
    over the blocks that have it (``layers.*.self_attn.q_proj``)."""

    name: str
    kind: str
    blocks: int  # how many blocks have it (0: outside the blocks)
    parameters: int
    bytes: int
    stored_as: str
    members: tuple[str, ...]  # the module paths summed here


def part_rows(parts: list[Part]) -> list[PartRow]:
    """Parts outside the blocks as they are; block parts summed by their name in the
    block, in the order they first appear."""
    groups: dict[str, list[Part]] = {}
    for part in parts:
        key = part.name if part.layer is None else f"layers.*.{part.name_in_block}"
        groups.setdefault(key, []).append(part)
    return [
        PartRow(
            name=key,
            kind=members[0].kind,
            blocks=0 if members[0].layer is None else len(members),
            parameters=sum(p.parameters for p in members),
            bytes=sum(p.bytes for p in members),
            stored_as=" / ".join(dict.fromkeys(p.stored_as for p in members)),
            members=tuple(p.name for p in members),
        )
        for key, members in groups.items()
    ]


@dataclass(frozen=True)
class BlockShare:
    """One block's parameters: attention, FFN, and the rest (its norms)."""

    layer: int
    attention: int
    ffn: int
    other: int

    @property
    def ffn_share(self) -> float:
        """The FFN's share of attention + FFN, as the seed's table counts it (2/3 there)."""
        both = self.attention + self.ffn
        return self.ffn / both if both else 0.0


def block_shares(parts: list[Part]) -> list[BlockShare]:
    layers = sorted({p.layer for p in parts if p.layer is not None})
    shares = []
    for layer in layers:
        members = [p for p in parts if p.layer == layer]
        attention = sum(p.parameters for p in members if p.kind == "attention")
        ffn = sum(p.parameters for p in members if p.kind == "ffn")
        other = sum(p.parameters for p in members) - attention - ffn
        shares.append(BlockShare(layer, attention, ffn, other))
    return shares


__all__ = ["Part", "PartRow", "BlockShare", "model_parts", "part_rows", "block_shares", "TEXTBOOK_FFN_SHARE"]
