"""Requests -> prompt token ids: chat messages through the model's chat template (as
transformers renders it, with the tools and template kwargs), legacy prompts as text or
ids. Every problem is a 400 that names the field."""

from __future__ import annotations

import json

from ..errors import UserError
from ..tokenizer import Tokenizer
from .errors import APIError, invalid
from .protocol import ChatCompletionRequest, ImagePart, Message

# Template variables the server sets itself; a chat_template_kwargs key may not replace them.
RESERVED_TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token", "unk_token",
                               "pad_token"}


def template_message(message: Message, tokenizer: Tokenizer | None = None) -> dict:
    """One message as chat templates expect it: content as a string (with images, see
    ``image_content``); an assistant's tool calls with their arguments as an object (as
    transformers documents, and as Qwen's and Llama's templates index them)."""
    # OpenAI's "developer" messages are what chat templates know as "system" ones.
    content = image_content(message, tokenizer) if message.image_urls() else message.text()
    rendered = {"role": "system" if message.role == "developer" else message.role, "content": content}
    if message.name:
        rendered["name"] = message.name
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning_content:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": arguments_object(call.function.arguments)}}
            for call in message.tool_calls
        ]
    return rendered


def image_content(message: Message, processor) -> str | list[dict]:
    """A message with images (``processor`` a ``VisionProcessor``): content parts in their
    order when the chat template reads ``{"type": "image"}`` parts, else the family's
    placeholders before the text."""
    if processor.chat_template and "image" in processor.chat_template:
        return [{"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
                for part in message.content]
    return processor.placeholder * len(message.image_urls()) + message.text()


def arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # not JSON: the template gets the text as it came


def template_supports_tools(template: str | None) -> bool:
    """A template that never reads the `tools` variable would drop them without a word."""
    return template is not None and "tools" in template


def chat_prompt(tokenizer: Tokenizer, request: ChatCompletionRequest, default_kwargs: dict) -> str:
    """The conversation rendered by the chat template, ending with the assistant's turn
    (text: the caller encodes it, and looks at how it ends)."""
    # The request's thinking switches are template variables too (chat_template_kwargs win).
    switches = {"enable_thinking": request.enable_thinking, "reasoning_effort": request.reasoning_effort}
    kwargs = {**default_kwargs, **{k: v for k, v in switches.items() if v is not None},
              **(request.chat_template_kwargs or {})}
    reserved = RESERVED_TEMPLATE_VARIABLES & set(kwargs)
    if reserved:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs may not set {sorted(reserved)}")
    tools = None
    if request.tools and request.tool_choice != "none":
        if not template_supports_tools(tokenizer.chat_template):
            raise invalid("tools", "this model's chat template does not render tools")
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    messages = [template_message(m, tokenizer) for m in request.messages]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools,
                                             **kwargs)
    except UserError as e:
        raise invalid("messages", str(e)) from None


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    """A legacy prompt's ids: text is encoded as `mlx-tfm generate` encodes it (BOS first
    when the tokenizer adds one); ids are taken as they are."""
    return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def check_prompt(ids: list[int], vocab_size: int, context: int | None, param: str) -> None:
    """A prompt the model can run: not empty, ids inside the vocabulary, shorter than the
    context (None: a rotating cache fits any length)."""
    if not ids:
        raise invalid(param, "the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise invalid(param, f"the prompt holds token ids outside the model's vocabulary of {vocab_size}")
    if context is not None and len(ids) >= context:
        raise APIError(400, f"the prompt is {len(ids)} tokens but the model's context is {context}: shorten it",
                       param=param, code="context_length_exceeded")
