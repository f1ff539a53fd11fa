"""Fine-tuning an encoder-decoder (T5) on prompt / completion pairs: the prompt is the
encoder's input, the completion (and EOS) the decoder's target, teacher-forced from the
decoder's start token. Batches are the decoders' (``prompt + completion`` rows with their
prompt lengths), split here, so data loading, LoRA, training and fusing are shared."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError
from .trainer import loss_fn


def split_rows(tokens: mx.array, lengths: mx.array, start_id: int):
    """Rows ``prompt + completion`` (B, T) with (prompt length, length) -> the encoder's
    padding mask (B, T) (the prompt only), the decoder's inputs and targets (B, T) (the
    completion moved to the start, after the start token) and the targets' mask (B, T)."""
    B, T = tokens.shape
    positions = mx.arange(T)[None]  # (1, T)
    prompt_length, length = lengths[:, 0:1], lengths[:, 1:2]
    encoder_mask = (positions < prompt_length).astype(mx.int32)
    targets = mx.take_along_axis(tokens, mx.minimum(prompt_length + positions, T - 1), axis=1)
    target_mask = positions < (length - prompt_length)
    decoder_inputs = mx.concatenate([mx.full((B, 1), start_id, tokens.dtype), targets[:, :-1]], axis=1)
    return encoder_mask, decoder_inputs, targets, target_mask


def seq2seq_loss(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """Mean cross-entropy of the completion's tokens given the prompt, and their count."""
    encoder_mask, decoder_inputs, targets, mask = split_rows(tokens, lengths, model.args.decoder_start_token_id)
    logits = model(tokens, decoder_inputs, encoder_mask)  # (B, T, V)
    ntoks = mask.sum()
    losses = nn.losses.cross_entropy(logits, targets) * mask
    return losses.astype(mx.float32).sum() / mx.maximum(ntoks, 1), ntoks


def loss_for(model):
    """The training loss of a model's kind: next-token for decoders, seq2seq for T5."""
    if model.args.kind == "encoder":
        raise UserError("fine-tuning an encoder is not supported here: mlx-tfm lora trains decoders and T5")
    return seq2seq_loss if model.args.kind == "encoder-decoder" else loss_fn


def check_prompts(examples: list, source: str) -> None:
    """Every example of an encoder-decoder needs a prompt for the encoder."""
    missing = sum(prompt_length == 0 for _, prompt_length in examples)
    if missing:
        raise UserError(f"{source}: {missing} example(s) have no prompt; an encoder-decoder trains on "
                        '"prompt" + "completion" records (the prompt is the encoder\'s input)')


__all__ = ["seq2seq_loss", "loss_for", "check_prompts", "split_rows"]
