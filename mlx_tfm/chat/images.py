"""The images of a chat (``/image PATH``): attached to the next message, kept with it.

Each image is read and preprocessed once (engine/images.py, through tokenizer/images.py's
loader, which refuses what is not an image) and its features computed once, at
``/image``; they are kept by the image's content digest. A user turn that carried images
names their digests (``turn["images"]``). Rendering the conversation writes each image's
placeholder where the template puts it and expands it into the image's tokens, so the
session's ``TokenCache`` holds them like any other tokens (recorded by their image's key,
so that another image in the same place is never taken for it): a follow-up question
reuses them from the cache, and only the tokens after the common prefix are fed (with the
features of the image tokens among them: ``ImageBoundModel``).
"""

from __future__ import annotations

import mlx.core as mx

from ..engine.images import ImageInputs, joined, read_images
from ..errors import UserError
from ..generation.images import ImageBoundModel, check_takes_images


class ChatImages:
    """The images attached to the next message (``pending``, digests) and every image seen
    so far: its preprocessed inputs and features, by digest."""

    def __init__(self, model, processor):
        self.model = model
        self.processor = processor
        self.pending: list[str] = []
        self.inputs: dict[str, ImageInputs] = {}
        self.features: dict[str, mx.array] = {}
        self.paths: dict[str, str] = {}  # where each image was read from (/save writes them)

    def attach(self, path: str) -> str:
        """Read, preprocess and encode the image at ``path`` for the next message; returns
        its digest. A text-only model, a missing file or a non-image is a ``UserError``."""
        check_takes_images(self.model, self.processor)
        inputs = read_images(self.processor, [path])
        digest = inputs.digests[0]
        self.paths.setdefault(digest, str(path))
        if digest not in self.features:
            self.inputs[digest] = inputs
            self.features[digest] = inputs.encode(self.model)
        self.pending.append(digest)
        return digest

    def with_paths(self, conversation):
        """A copy of ``conversation`` whose turns name their images by path (to save it)."""
        return self._mapped(conversation, lambda digests: [self.paths[d] for d in digests])

    def with_digests(self, conversation):
        """A copy of ``conversation`` whose turns name every image by digest: a path (a
        loaded conversation's) is read and encoded again; a path that no longer holds an
        image is a ``UserError``."""
        def read(names: list[str]) -> list[str]:
            digests = []
            for name in names:
                if name not in self.features:  # a path: read and encoded, for its own turn, not the next one
                    name = self.attach(name)
                    self.pending.pop()
                digests.append(name)
            return digests

        return self._mapped(conversation, read)

    @staticmethod
    def _mapped(conversation, change):
        turns = [{**turn, "images": change(turn["images"])} if turn.get("images") else turn
                 for turn in conversation.turns]
        return type(conversation)(conversation.system, turns)

    def take_pending(self) -> list[str]:
        pending, self.pending = self.pending, []
        return pending

    @staticmethod
    def of(messages: list[dict]) -> list[str]:
        """The digests of the images in ``messages``, in order."""
        return [digest for message in messages for digest in message.get("images", ())]

    def template_message(self, message: dict) -> dict:
        """A message as the chat template reads it: with images, the processor's image
        message (content parts, or placeholders before the text)."""
        if not message.get("images"):
            return {"role": message["role"], "content": message["content"]}
        return {**self.processor.image_message(message["content"], len(message["images"])), "role": message["role"]}

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The conversation's ids, each image's tokens in place."""
        rendered = [self.template_message(m) for m in messages]
        text = self.processor.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        digests = self.of(messages)
        if digests:
            text = joined([self.inputs[d] for d in digests]).expand(self.processor, text)
        return self.processor.encode(text, add_special_tokens=False)

    def keys(self, messages: list[dict], ids: list[int]) -> list[int]:
        """``ids`` (the rendered ``messages``) as the session's cache records them: each
        image token its image's key (engine/images.py), so that a cache holding another
        image's tokens is never taken for this one's. ``ids`` itself when there are none."""
        digests = self.of(messages)
        if not digests:
            return ids
        return joined([self.inputs[d] for d in digests]).cache_keys(ids, self.model.vision_args.image_token_id)

    def bound(self, messages: list[dict], target: list[int]):
        """The model to feed ``target`` (the rendered ``messages``) through: bound to their
        images' features (and, for Qwen's models, the conversation's M-RoPE positions), or
        the model itself when they have none."""
        digests = self.of(messages)
        if not digests:
            return self.model
        features = mx.concatenate([self.features[d] for d in digests])
        grids = joined([self.inputs[d] for d in digests]).tower_inputs.get("grid_thw")
        rope = None if grids is None else self.model.rope_positions(target, grids)
        return ImageBoundModel(self.model, features, target, rope)


def refuse_with_draft(draft_model) -> None:
    if draft_model is not None:
        raise UserError("images cannot be used with a draft model (it reads text only): "
                        "start chat without --draft-model")


__all__ = ["ChatImages", "refuse_with_draft"]
