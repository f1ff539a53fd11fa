"""The other two of the seed's three architectures, built from the one model's parts.

- ``EncoderModel`` (kind "encoder", the BERT family): the stack of ``TransformerModel``
  attending both ways over the padding mask, then a head (``mlx_tfm.model.heads``): hidden
  states, masked-LM logits or class logits, as transformers' ``*Model``,
  ``*ForMaskedLM`` and ``*ForSequenceClassification`` return them.
- ``EncoderDecoderModel`` (kind "encoder-decoder", T5): one shared token table, an encoder
  stack (bidirectional) and a decoder stack whose blocks also attend over the encoder's
  output (cross-attention), then the LM head. ``encode`` runs once per input;
  ``bind(memory)`` gives a decoder that decodes step by step with its own KV cache and
  the cross-attention keys and values projected once.

``make_model(args)`` builds whichever ``args.kind`` names. Pure math, as ``model.py``.

Shapes: B batch, L positions, S encoder positions, D hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from .cache import CrossAttentionCache, KVCache
from .config import ModelArgs
from .gemma4_vision import Gemma4VisionLanguageModel
from .heads import ClassificationHead, MaskedLMHead
from .lfm2_vl_vision import Lfm2VlModel
from .pixtral_vision import PixtralVisionLanguageModel
from .transformer import Model, TransformerModel
from .vision_language import VisionLanguageModel

HEADS = ("none", "masked_lm", "classification")
KINDS = ("decoder", "encoder", "encoder-decoder")


def padding_mask(attention_mask: mx.array | None) -> mx.array | None:
    """transformers' ``attention_mask`` (B, S), 1 at tokens, -> boolean (B, 1, 1, S)."""
    if attention_mask is None:
        return None
    return (attention_mask != 0)[:, None, None, :]


class EncoderModel(nn.Module):
    """A BERT-family encoder: ``model(input_ids, token_type_ids, attention_mask)`` -> the
    head's output (hidden states (B, L, D), logits (B, L, V) or class logits (B, labels))."""

    # The sentence-transformers pipeline read with the weights (``mlx_tfm.weights.sentence_modules``;
    # None: its defaults): not math, but what ``mlx_tfm.encode`` runs after this model.
    sentence_modules = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.head not in HEADS:
            raise ValueError(f"unknown head {args.head!r} ({', '.join(HEADS)})")
        self.args = args
        self.model = TransformerModel(args)
        if args.head == "masked_lm":
            self.lm_head = MaskedLMHead(args)
        elif args.head == "classification":
            if args.num_labels < 1:
                raise ValueError("a classification head needs num_labels >= 1")
            self.classifier = ClassificationHead(args)

    def __call__(self, input_ids: mx.array, token_type_ids: mx.array | None = None,
                 attention_mask: mx.array | None = None) -> mx.array:
        hidden = self.hidden_states(input_ids, token_type_ids, attention_mask)
        if self.args.head == "masked_lm":
            return self.lm_head(hidden, self.model.embed_tokens)
        if self.args.head == "classification":
            mask = attention_mask if attention_mask is not None else mx.ones(input_ids.shape, mx.int32)
            return self.classifier(hidden, mask)
        return hidden

    def hidden_states(self, input_ids: mx.array, token_type_ids: mx.array | None = None,
                      attention_mask: mx.array | None = None) -> mx.array:
        """The last layer's hidden states (B, L, D), before any head: what embeddings pool."""
        return self.model(input_ids, padding_mask(attention_mask), token_type_ids=token_type_ids)

    @property
    def layers(self) -> list:
        return self.model.layers


def stack_args(args: ModelArgs, decoder: bool) -> ModelArgs:
    """The args of one of T5's stacks: the encoder attends both ways; the decoder attends
    causally, over the encoder too, with its own number of layers."""
    n_layers = (args.num_decoder_layers or args.num_hidden_layers) if decoder else args.num_hidden_layers
    return dataclasses.replace(
        args, kind="decoder" if decoder else "encoder", cross_attention=decoder, own_embeddings=False,
        num_hidden_layers=n_layers, layer_types=(args.layer_types[0],) * n_layers,
    )


class EncoderDecoderModel(nn.Module):
    """T5: ``model(input_ids, decoder_input_ids, attention_mask)`` -> decoder logits
    (B, L_dec, V), teacher-forced; ``encode`` + ``bind`` for decoding step by step."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.shared = nn.Embedding(args.vocab_size, args.hidden_size)
        self.encoder = TransformerModel(stack_args(args, decoder=False))
        self.decoder = TransformerModel(stack_args(args, decoder=True))
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, input_ids: mx.array, decoder_input_ids: mx.array,
                 attention_mask: mx.array | None = None) -> mx.array:
        memory = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, self.cross_caches(memory, attention_mask))

    def encode(self, input_ids: mx.array, attention_mask: mx.array | None = None) -> mx.array:
        """The encoder's output (B, S, D), computed once per input."""
        return self.encoder(self.shared(input_ids), padding_mask(attention_mask))

    def cross_caches(self, memory: mx.array, attention_mask: mx.array | None = None) -> list[CrossAttentionCache]:
        """One cross-attention cache per decoder layer over ``memory``: each layer projects
        its keys and values from it once, however many steps read them."""
        mask = padding_mask(attention_mask)
        return [CrossAttentionCache(memory, mask) for _ in self.decoder.layers]

    def decode(self, decoder_input_ids: mx.array, cross: list[CrossAttentionCache], cache: list | None = None,
               mask=None) -> mx.array:
        """Decoder token ids (B, L) -> logits (B, L, V), after what ``cache`` holds."""
        h = self.decoder(self.shared(decoder_input_ids), mask, cache, cross=cross)
        return self.head(h)

    def head(self, h: mx.array) -> mx.array:
        """The decoder's hidden states -> logits; a tied head reads them scaled by
        d_model^-0.5 (t5-small's convention, ``logit_scale``)."""
        logits = self.shared.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        return logits * self.args.logit_scale if self.args.logit_scale != 1.0 else logits

    def make_cache(self, max_kv_size: int | None = None, keep: int = 0) -> list:
        """The decoder's self-attention caches, one per layer. Never bounded: the relative
        position bias of a step is computed over every position before it."""
        if max_kv_size is not None:
            raise ValueError("an encoder-decoder's relative positions need every decoded position: no max_kv_size")
        return [KVCache() for _ in self.decoder.layers]

    def bind(self, memory: mx.array, attention_mask: mx.array | None = None) -> "BoundDecoder":
        """The decoder over one encoded input: a decoder-only model to ``generate_step``."""
        return BoundDecoder(self, self.cross_caches(memory, attention_mask))

    @property
    def layers(self) -> list:
        """Encoder blocks then decoder blocks: the last n (LoRA's ``num_layers``) are the decoder's."""
        return self.encoder.layers + self.decoder.layers


class BoundDecoder:
    """T5's decoder bound to one encoded input, shaped like a decoder-only model:
    ``decoder(tokens (B, L), mask=None, cache=None) -> logits``, ``make_cache()``, ``args``.
    The generation loop (samplers, stop rules, streaming) runs it unchanged."""

    def __init__(self, model: EncoderDecoderModel, cross: list[CrossAttentionCache]):
        self.model = model
        self.cross = cross
        self.args = dataclasses.replace(model.args, kind="decoder", max_position_embeddings=1 << 30)

    def __call__(self, tokens: mx.array, mask=None, cache: list | None = None) -> mx.array:
        return self.model.decode(tokens, self.cross, cache, mask)

    def make_cache(self, max_kv_size: int | None = None, keep: int = 0) -> list:
        return self.model.make_cache(max_kv_size, keep)


# VisionArgs.tower_kind -> the image-text model class that builds that tower
VISION_LANGUAGE_MODELS = {"vit": VisionLanguageModel, "pixtral": PixtralVisionLanguageModel,
                          "siglip2_naflex": Lfm2VlModel, "gemma4": Gemma4VisionLanguageModel}


def make_model(args: ModelArgs) -> nn.Module:
    """The model ``args.kind`` names: ``Model`` (decoder), ``EncoderModel`` or
    ``EncoderDecoderModel``."""
    if args.kind not in KINDS:
        raise ValueError(f"unknown kind {args.kind!r} ({', '.join(KINDS)})")
    if args.vision is not None:  # a decoder reading images too, its tower by VisionArgs.tower_kind
        kind = args.vision.get("tower_kind", "vit")
        if kind not in VISION_LANGUAGE_MODELS:
            raise ValueError(f"unknown vision tower kind {kind!r} ({', '.join(VISION_LANGUAGE_MODELS)})")
        return VISION_LANGUAGE_MODELS[kind](args)
    if args.kind == "encoder":
        return EncoderModel(args)
    if args.kind == "encoder-decoder":
        return EncoderDecoderModel(args)
    return Model(args)


__all__ = ["EncoderModel", "EncoderDecoderModel", "BoundDecoder", "make_model", "padding_mask"]
