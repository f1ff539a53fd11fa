"""Masked-language-model pre-training (``mlx-tfm train --objective mlm``), the seed's
recipe for BERT: choose 15% of the tokens as prediction targets; of those, 80% become
[MASK], 10% a random token and 10% stay as they are (so the model must represent every
position, not only masks); the loss is the cross-entropy at the chosen positions only.

The model is a BERT (``model_type`` bert with its masked-LM head) of a preset shape or a
config file, saved with a Hugging Face ``BertForMaskedLM`` config.json and the one
model's tensor names, which ``mlx_tfm.load`` and ``mlx-tfm fill-mask`` read.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserError
from ..families import model_args_from_config
from ..jsonfile import read_json
from ..model.config import ModelArgs
from .data import ByteTokenizer

CHOSEN, AS_MASK, AS_RANDOM = 0.15, 0.8, 0.1  # the rest of the chosen (10%) stay themselves

# BERT shapes for --config NAME, in BertConfig's keys; the vocabulary is the tokenizer's.
MLM_PRESETS: dict[str, dict] = {
    "micro": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256},
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 512},  # BERT-tiny
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024},
}


def mask_tokens(tokens: mx.array, mask_id: int, vocab_size: int, special: mx.array | None = None
                ) -> tuple[mx.array, mx.array]:
    """(inputs, chosen): ``tokens`` (B, L) with 15% of the positions chosen (never a
    special token: ``special`` (V,) bool), 80% of those replaced by ``mask_id``, 10% by a
    random token, 10% kept; ``chosen`` (B, L) bool marks the prediction targets."""
    chosen = mx.random.uniform(shape=tokens.shape) < CHOSEN
    if special is not None:
        chosen = chosen & ~special[tokens]
    draw = mx.random.uniform(shape=tokens.shape)
    as_mask = chosen & (draw < AS_MASK)
    as_random = chosen & (draw >= AS_MASK) & (draw < AS_MASK + AS_RANDOM)
    random_tokens = mx.random.randint(0, vocab_size, tokens.shape, dtype=tokens.dtype)
    inputs = mx.where(as_mask, mx.array(mask_id, tokens.dtype), mx.where(as_random, random_tokens, tokens))
    return inputs, chosen


def make_mlm_loss(mask_id: int, vocab_size: int, special_ids: list[int]):
    """``loss(model, tokens, lengths) -> (mean cross-entropy over the chosen, their count)``,
    the trainer's loss signature; fresh masks at every call (MLX's seeded random state)."""
    special = np.zeros(vocab_size, bool)
    special[special_ids] = True
    special = mx.array(special)

    def mlm_loss(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
        inputs, chosen = mask_tokens(tokens, mask_id, vocab_size, special)
        logits = model(inputs)  # (B, L, V): both directions, no padding in a window
        losses = nn.losses.cross_entropy(logits, tokens) * chosen
        ntoks = chosen.sum()
        return losses.astype(mx.float32).sum() / mx.maximum(ntoks, 1), ntoks

    return mlm_loss


def bert_config(spec: str, vocab_size: int, max_positions: int, ids: dict) -> dict:
    """A BertForMaskedLM config.json of a preset or a JSON file of BertConfig keys."""
    if spec in MLM_PRESETS:
        fields = dict(MLM_PRESETS[spec])
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"--config {spec!r} is neither a preset ({', '.join(MLM_PRESETS)}) nor a JSON file")
        fields = read_json(path)
    return {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_act": "gelu", "layer_norm_eps": 1e-12,
        "type_vocab_size": 2, "max_position_embeddings": max_positions, **fields, "vocab_size": vocab_size, **ids,
    }


def mlm_setup(spec: str, tokenizer, seq_len: int) -> tuple[ModelArgs, dict, object]:
    """(model args, config.json, loss) for a BERT pre-trained on ``tokenizer``'s ids."""
    mask_id = None if isinstance(tokenizer, ByteTokenizer) else tokenizer.special_token_id("mask_token")
    if mask_id is None:
        raise UserError("--objective mlm needs a tokenizer with a mask token (a BERT-family tokenizer folder)")
    names = ("pad_token", "cls_token", "sep_token", "unk_token", "bos_token", "eos_token", "mask_token")
    special_ids = sorted({i for i in (tokenizer.special_token_id(n) for n in names) if i is not None})
    ids = {"pad_token_id": tokenizer.special_token_id("pad_token") or 0}
    config = bert_config(spec, tokenizer.vocab_size, max(512, seq_len + 1), ids)
    try:
        args = model_args_from_config(config)
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"--config {spec}: {e}") from None
    return args, config, make_mlm_loss(mask_id, args.vocab_size, special_ids)


__all__ = ["mask_tokens", "make_mlm_loss", "mlm_setup", "MLM_PRESETS"]
