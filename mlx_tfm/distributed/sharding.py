"""A model split over the ranks of a launch, for generation larger than one machine.

Both splits are module surgery on the model ``build_model`` returns before anything is
evaluated: its weights are still lazy arrays over the safetensors files, so a rank reads
only what it keeps.

- ``pipeline``: each rank keeps a contiguous block of layers (earlier ranks one more
  when they do not divide). Rank r > 0 receives the hidden states from rank r - 1 in
  place of its embeddings' output, runs its layers and sends them on; after the last
  layer every rank holds the last rank's states (one all-gather), so every rank computes
  the same logits and samples the same token: the ranks never need to be told it. A rank
  reads only its own layers' weights (and the embeddings and head, which all keep).
  For memory, not speed: one rank works at a time.
- ``tensor_parallel``: every layer is split across the ranks (Megatron's layout): the
  q, k, v projections and the MLP's gate and up by output rows (each rank a share of
  the heads and of the hidden units, ``nn.AllToShardedLinear``), the attention output
  and the MLP's down projection by input columns (``nn.ShardedToAllLinear``), so each
  sublayer ends with one all-sum. A mixture of experts splits every expert's hidden
  units the same way and sums the block's output once. A rank keeps a 1/N slice of each
  of these matrices; each matrix passes through memory whole once while it is cut.

Only decoder-only models are split (encoders and T5 are refused with one line). A
pipeline splits a stack with recurrent layers (LFM2's short convolutions...) like any
other: each rank's layers make their own caches, a ``StateCache`` where the layer keeps
a state. Tensor parallelism splits attention heads only, and refuses recurrent layers
(Gated DeltaNet, Mamba, short convolutions), MLA and Falcon-H1's parallel Mamba mixer.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

from ..errors import UserError
from ..model.attention import Attention
from ..model.experts import QuantizedSwitchLinear, SparseMoeBlock
from ..model.layers import MLP
from ..model.mixers import ATTENTION_TYPES
from ..model.transformer import Model
from .world import World

MODES = ("pipeline", "tensor")
FLAGS = {"pipeline": "--pipeline", "tensor": "--tensor-parallel"}


def check_splittable(model: Model, mode: str) -> None:
    if model.args.kind != "decoder":
        raise UserError(f"{FLAGS[mode]} splits decoder-only models; {model.args.model_type} is an {model.args.kind}")
    if model.args.num_kv_shared_layers or model.args.hidden_size_per_layer_input:
        # Gemma 4: layers read other layers' keys and values, and per-layer inputs by their index
        raise UserError(f"{FLAGS[mode]} does not split models with KV-shared layers or per-layer inputs "
                        f"({model.args.model_type})")


def layer_span(n_layers: int, rank: int, size: int) -> range:
    """The contiguous block of layers rank ``rank`` of ``size`` keeps."""
    base, extra = divmod(n_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


# -- pipeline ------------------------------------------------------------------------------


class PipelineEnd(nn.Module):
    """A rank's first and/or last block with the pipeline's hand-offs around it: states
    received from the rank before (in place of ``x``, which only gives their shape),
    sent to the rank after, and gathered from the last rank by every rank."""

    def __init__(self, block: nn.Module, group, receive_from: int | None, send_to: int | None, gather: bool):
        super().__init__()
        self.block = block
        self.group, self.receive_from, self.send_to, self.gather = group, receive_from, send_to, gather

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if self.receive_from is not None:
            x = mx.distributed.recv_like(x, self.receive_from, group=self.group)
        h = self.block(x, mask, cache).astype(x.dtype)
        if self.send_to is not None:
            h = mx.distributed.send(h, self.send_to, group=self.group)
            # Sent now: a caller that evaluates only the caches (a prompt's prefill) would
            # otherwise never send, and the next rank would wait for these states forever.
            mx.eval(h)
        if self.gather:
            h = mx.distributed.all_gather(h, group=self.group)[-x.shape[0] :]  # (size * B, L, D) -> the last rank's
        return h

    @property
    def mixer(self) -> nn.Module:
        """The wrapped block's token mixer (``Model.make_cache`` asks it for its cache)."""
        return self.block.mixer


def pipeline(model: Model, world: World) -> None:
    """Keep this rank's block of layers (see the module docstring), in place."""
    check_splittable(model, "pipeline")
    stack = model.model
    n_layers = len(stack.layers)
    if n_layers < world.size:
        raise UserError(f"--pipeline: the model has {n_layers} layers, fewer than the {world.size} ranks")
    span = layer_span(n_layers, world.rank, world.size)
    mine = stack.layers[span.start : span.stop]
    receive_from = world.rank - 1 if world.rank > 0 else None
    send_to = world.rank + 1 if world.rank < world.size - 1 else None
    if len(mine) == 1:
        mine[0] = PipelineEnd(mine[0], world.group, receive_from, send_to, gather=True)
    else:
        mine[0] = PipelineEnd(mine[0], world.group, receive_from, None, gather=False)
        mine[-1] = PipelineEnd(mine[-1], world.group, None, send_to, gather=True)
    stack.layers = mine
    stack.windows = [stack.windows[i] for i in span]  # make_cache: one cache per kept layer
    stack.chunks = [stack.chunks[i] for i in span]  # and Llama 4's chunked layers among them
    for block in mine:
        mx.eval(block.parameters())  # read this rank's layers, one at a time


# -- tensor parallel -------------------------------------------------------------------------


class SummedOverRanks(nn.Module):
    """A sublayer of which every rank computes a part: the output is their sum."""

    def __init__(self, sublayer: nn.Module, group):
        super().__init__()
        self.sublayer, self.group = sublayer, group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.sublayer(x), group=self.group)


def check_tensor_split(model: Model, size: int) -> None:
    """One line for a model whose heads or hidden units do not split over ``size`` ranks."""
    args = model.args
    recurrent = [(i, kind) for i, kind in enumerate(args.layer_types) if kind not in ATTENTION_TYPES]
    if recurrent:
        layer, kind = recurrent[0]
        raise UserError(f"--tensor-parallel splits attention heads, and layer {layer} is a {kind!r} layer "
                        "(a recurrent state); use --pipeline")
    unsplit = unsplit_attention_kind(args)
    if unsplit:
        raise UserError(f"--tensor-parallel splits the q, k and v projections of plain attention, and layer 0 is "
                        f"{unsplit}; use --pipeline")
    counts = {"num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads}
    dense = any(not args.has_experts(i) for i in range(args.num_hidden_layers))
    if dense:
        counts["intermediate_size"] = args.intermediate_size
    if args.num_experts:
        counts["moe_intermediate_size"] = args.moe_intermediate_size
    if args.shared_expert_intermediate_size:
        counts["shared_expert_intermediate_size"] = args.shared_expert_intermediate_size
    for name, count in counts.items():
        if count % size:
            raise UserError(f"--tensor-parallel: {name} ({count}) does not split over {size} ranks; "
                            "use --pipeline, or a number of ranks that divides it")
    if args.qk_norm and args.qk_norm_scope == "projection":
        raise UserError("--tensor-parallel: this model normalises q and k over all heads at once, which a rank "
                        "holding some of the heads cannot do; use --pipeline")


def unsplit_attention_kind(args) -> str | None:
    """The attention layers' kind in words when it is not the plain q, k, v attention that
    ``split_attention`` cuts (None when it is): MLA's keys and values come from one
    latent every head shares, and Falcon-H1's attention has a Mamba-2 state beside it."""
    if args.kv_lora_rank:
        return "MLA (latent attention: keys and values expanded from a shared low-rank latent)"
    if args.mamba_beside_attention:
        return "attention with a Mamba-2 mixer beside it (a recurrent state)"
    return None


def check_columns(layer: nn.Module, size: int, name: str) -> None:
    """A quantized matrix split by input columns must keep whole quantization groups."""
    if isinstance(layer, nn.QuantizedLinear):
        in_dims, group_size = layer.weight.shape[-1] * 32 // layer.bits, layer.group_size
    elif isinstance(layer, QuantizedSwitchLinear):
        in_dims, group_size = layer.input_dims, layer.group_size
    else:
        return
    if in_dims % size or (in_dims // size) % group_size:
        raise UserError(f"--tensor-parallel: {name}'s {in_dims} inputs in quantization groups of {group_size} do not "
                        f"split over {size} ranks; use --pipeline")


def split_attention(attention: Attention, world: World) -> None:
    group, size = world.group, world.size
    check_columns(attention.o_proj, size, "the attention output")
    attention.q_proj = shard_linear(attention.q_proj, "all-to-sharded", group=group)
    attention.k_proj = shard_linear(attention.k_proj, "all-to-sharded", group=group)
    attention.v_proj = shard_linear(attention.v_proj, "all-to-sharded", group=group)
    attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
    attention.n_heads //= size
    attention.n_kv_heads //= size
    if "sinks" in attention:
        start = world.rank * attention.n_heads
        attention.sinks = attention.sinks[start : start + attention.n_heads]


def split_mlp(mlp: MLP, world: World) -> None:
    check_columns(mlp.down_proj, world.size, "the MLP's down projection")
    if mlp.gated:
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=world.group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=world.group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=world.group)


def split_in_place(up: list[nn.Module], down: nn.Module, world: World) -> None:
    """Rows of ``up``'s matrices and columns of ``down``'s, without communication: the
    caller sums the outputs. ``down``'s bias is added by rank 0 alone."""
    for layer in up:
        shard_inplace(layer, "all-to-sharded", group=world.group)
    shard_inplace(down, "sharded-to-all", group=world.group)
    if "bias" in down and world.rank > 0:
        down.bias = mx.zeros(down.bias.shape, down.bias.dtype)


def split_experts(block: SparseMoeBlock, world: World) -> SummedOverRanks:
    """Every expert's hidden units (and the shared expert's) split over the ranks; the
    router stays whole on every rank, so each rank picks the same experts."""
    experts = block.switch_mlp
    check_columns(experts.down_proj, world.size, "the experts' down projection")
    split_in_place([experts.gate_proj, experts.up_proj], experts.down_proj, world)
    if "shared_expert" in block:
        shared = block.shared_expert
        split_in_place(([shared.gate_proj] if shared.gated else []) + [shared.up_proj], shared.down_proj, world)
    return SummedOverRanks(block, world.group)


def tensor_parallel(model: Model, world: World) -> None:
    """Split every layer's attention and feed-forward over the ranks, in place."""
    check_splittable(model, "tensor")
    check_tensor_split(model, world.size)
    for block in model.layers:
        split_attention(block.self_attn, world)
        if isinstance(block.mlp, SparseMoeBlock):
            block.mlp = split_experts(block.mlp, world)
        else:
            split_mlp(block.mlp, world)
        mx.eval(block.parameters())  # read and cut this layer's matrices, one layer at a time


def splitter(mode: str | None, world: World):
    """The surgery ``load(..., shard=)`` applies for ``mode`` ("pipeline", "tensor"; None: none)."""
    if mode is None:
        return None
    split = {"pipeline": pipeline, "tensor": tensor_parallel}[mode]
    return lambda model: split(model, world)
