"""Generation from the models that are not decoders: an encoder-decoder (T5) reads the
prompt with its encoder once, and its decoder, bound to that output, is the decoder-only
model the generation loop runs (the same samplers, stop rules and streaming), starting
from ``decoder_start_token_id``. An encoder (the BERT family) generates nothing: the
error says which command serves it."""

from __future__ import annotations

import mlx.core as mx

from ..errors import UserError

ENCODER_COMMANDS = "an encoder model ({}): use mlx-tfm embed (or fill-mask / rerank)"


def check_decoder(model, command: str) -> None:
    """``command`` (generate, chat, ...) needs a model that decodes."""
    kind, model_type = model.args.kind, model.args.model_type
    if kind == "encoder":
        raise UserError(ENCODER_COMMANDS.format(model_type))
    if kind == "encoder-decoder" and command != "generate":
        raise UserError(f"an encoder-decoder model ({model_type}): {command} keeps a decoder's cache of the "
                        "whole conversation; use mlx-tfm generate")


def decoder_for_prompt(model, tokenizer, prompt: str | list[int] | mx.array):
    """(the decoder bound to the encoded ``prompt``, the decoder's own prompt) for an
    encoder-decoder; an encoder is refused. The prompt's text gets the tokenizer's special
    tokens (T5's ends with </s>)."""
    check_decoder(model, "generate")
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    ids = mx.array(prompt, dtype=mx.int32).reshape(1, -1)  # (1, S)
    if ids.size == 0:
        raise UserError("the prompt is empty: give some text (or token ids) to continue")
    if ids.min().item() < 0 or ids.max().item() >= model.args.vocab_size:
        raise UserError(f"the prompt holds token ids outside the model's vocabulary of {model.args.vocab_size}")
    memory = model.encode(ids)
    mx.eval(memory)
    return model.bind(memory), [model.args.decoder_start_token_id]


__all__ = ["check_decoder", "decoder_for_prompt"]
