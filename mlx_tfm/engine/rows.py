"""The engine's view of a request: a ``Row`` (its tokens, how far its cache has read them,
its sampling settings, random key, processors and text pieces) and a ``RowBatch`` (rows
with one batched cache per layer, kept in step: row i of every layer is ``rows[i]``).
The prefill group and the decoding batch are each a ``RowBatch``.

A row with images on a Qwen model (M-RoPE) carries its prompt's 3D positions and its
rope_delta (``Row.rope``): every chunk and decoding step of a batch holding such a row
passes each row's positions (``mrope_inputs``), so that each turns at its own."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..errors import UserError
from ..generation.sampling import penalties_for
from ..generation.step import context_room
from ..generation.stream import TextPieces
from ..model.mrope import sequence_positions
from ..model.vision_language import VisionLanguageModel
from .batch_cache import BatchCache
from .images import image_token_counts
from .requests import MAX_TOP_LOGPROBS, Event, Request


class Row:
    """One admitted request."""

    def __init__(self, request_id: int, request: Request, on_event: Callable[[Event], None]):
        self.id = request_id
        self.request = request
        self.on_event = on_event
        self.tokens = list(request.prompt)  # the prompt, then every generated token
        self.fed = 0  # tokens[:fed] are in the row's cache; tokens[fed] is fed next
        self.cached_tokens = 0
        # recurrent layers' states taken while the prompt was read: position -> {layer: state}
        self.snapshots: dict[int, dict] = {}
        self.generated = 0
        self.max_tokens = request.max_tokens
        self.finish_reason: str | None = None
        self.settings = request.sampling
        self.key: mx.array | None = None
        self.processors: list = []
        self.pieces: TextPieces | None = None
        self.prompt_keys = self.tokens[:]  # what the prefix cache compares (images: their keys)
        self.image_counts: list[int] | None = None  # image tokens before each prompt position
        self.features: mx.array | None = None  # the images' features, once a chunk needs them
        self.rope: tuple[mx.array, int] | None = None  # M-RoPE: the prompt's positions (3, 1, L), its rope_delta

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt)

    @property
    def pending(self) -> int:
        """Prompt tokens still to prefill (all but the last, which the first decoding step feeds)."""
        return max(0, self.prompt_length - 1 - self.fed)

    @property
    def prefilled(self) -> bool:
        return self.pending == 0

    @property
    def cache_keys(self) -> list[int]:
        """``tokens`` as the prefix cache sees them: each image token its image's key."""
        return self.prompt_keys + self.tokens[self.prompt_length:]

    def chunk_features(self, model, start: int, end: int) -> mx.array | None:
        """The image features of prompt positions ``start:end`` (n, D), None when they hold
        no image token; the tower runs the first time a chunk needs it."""
        if self.image_counts is None or self.image_counts[start] == self.image_counts[end]:
            return None
        if self.features is None:
            self.features = self.request.images.encode(model)
        return self.features[self.image_counts[start]:self.image_counts[end]]

    def positions(self, length: int) -> mx.array:
        """M-RoPE positions (3, 1, length) of the row's next ``length`` tokens (from ``fed``):
        its prompt's, then text ``rope_delta`` behind the count; a text row's are its indices."""
        return sequence_positions(*(self.rope or (None, 0)), self.fed, length)

    def _prepare_images(self, model) -> None:
        """Check the request's images against the model and its prompt; key them."""
        images, prompt = self.request.images, self.request.prompt
        if images is None:
            return
        if not isinstance(model, VisionLanguageModel):
            raise UserError(f"this model ({model.args.model_type}) reads text only: it takes no images")
        if model.vision_args.image_attention == "bidirectional":  # its mask needs one offset for the whole batch
            raise UserError(f"{model.args.model_type}'s image tokens attend to each other both ways, which the "
                            "batching engine does not do yet: use mlx-tfm generate --image")
        image_token_id = model.vision_args.image_token_id
        if prompt[-1] == image_token_id:  # the first decoding step feeds it, without features
            raise UserError("the prompt ends with an image's tokens: put text after the image")
        self.prompt_keys = images.cache_keys(prompt, image_token_id)
        self.image_counts = image_token_counts(prompt, image_token_id)
        if "grid_thw" in images.tower_inputs:  # Qwen's: the positions follow each image's grid
            self.rope = model.rope_positions(prompt, images.tower_inputs["grid_thw"])

    def event(self, token, text, finish_reason, logprob=None, top=None, error=None, internal=False) -> Event:
        return Event(token=token, text=text, logprob=logprob, top_logprobs=top, finish_reason=finish_reason,
                     prompt_tokens=self.prompt_length, cached_tokens=self.cached_tokens,
                     generation_tokens=self.generated, error=error, internal=internal)

    def prepare(self, model, tokenizer, single_caches: list, seed: int) -> None:
        """Check the request and build the row's key (from its own seed, else ``seed``),
        processors and text pieces; a ``UserError`` is the request's one error event.
        ``single_caches`` (``model.make_cache``'s) say how long the context is."""
        request, vocab_size = self.request, model.args.vocab_size
        prompt = request.prompt
        if not prompt:
            raise UserError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise UserError(f"the prompt holds token ids outside the model's vocabulary of {vocab_size}")
        if request.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        self.settings.check(vocab_size)
        self._prepare_images(model)
        room = context_room(model, single_caches, len(prompt))
        self.max_tokens = request.max_tokens if room is None else min(request.max_tokens, room)
        self.key = mx.random.key(self.settings.seed if self.settings.seed is not None else seed)
        # the logit bias is added for the whole batch at once (SamplingRows); these run per row
        self.processors = penalties_for(self.settings, len(prompt)) + list(request.logits_processors)
        self.pieces = TextPieces(tokenizer, mx.array(prompt), list(request.stop_strings))


def mrope_inputs(rows: list[Row], length: int) -> dict:
    """``{"positions": (3, B, length)}``, every row's next ``length`` positions, when a row
    turns by its images' M-RoPE positions; else ``{}`` (each row turns at its offset)."""
    if all(row.rope is None for row in rows):
        return {}
    return {"positions": mx.concatenate([row.positions(length) for row in rows], axis=1)}


class RowBatch:
    """Rows and one ``BatchCache`` per layer whose row i is ``rows[i]``."""

    def __init__(self, kinds: list[BatchCache]):
        self.kinds = kinds  # an empty cache per layer: what a new batch of that layer starts as
        self.rows: list[Row] = []
        self.caches = self._empty()

    def _empty(self) -> list[BatchCache]:
        return [kind.select([]) for kind in self.kinds]

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Row], caches: list[list[BatchCache]]) -> None:
        """Append ``rows``; ``caches`` holds one list per layer of batched caches with
        their rows, in order (each layer's rows join in one copy)."""
        self.rows += rows
        for layer, joining in zip(self.caches, caches):
            layer.extend(*joining)

    def keep(self, indices: list[int]) -> None:
        """Keep only the rows at ``indices``, in that order."""
        self.rows = [self.rows[i] for i in indices]
        self.caches = [layer.select(indices) for layer in self.caches]

    def take(self, indices: list[int]) -> tuple[list[Row], list[BatchCache]]:
        """Remove the rows at ``indices`` and return them with their caches (all of them:
        the caches themselves, without a copy)."""
        chosen = set(indices)
        rest = [i for i in range(len(self.rows)) if i not in chosen]
        if not rest:
            taken = (self.rows, self.caches)
            self.clear()
            return taken
        taken = ([self.rows[i] for i in indices], [layer.select(indices) for layer in self.caches])
        self.keep(rest)
        return taken

    def remove_finished(self, remember: Callable[[Row, list[BatchCache], int], None]) -> bool:
        """Drop the finished rows, after ``remember(row, caches, index)`` for each that did
        not fail; whether any left."""
        done = [i for i, row in enumerate(self.rows) if row.finish_reason is not None]
        for i in done:
            if self.rows[i].finish_reason != "error":
                remember(self.rows[i], self.caches, i)
        if done:
            self.keep([i for i, row in enumerate(self.rows) if row.finish_reason is None])
        return bool(done)

    def clear(self) -> None:
        self.rows, self.caches = [], self._empty()


__all__ = ["Row", "RowBatch", "mrope_inputs"]
