"""Chat templates, rendered with jinja2 in the environment transformers uses, so a model's
template gives the same prompt here as in ``transformers``."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from ..errors import UserError

# Used by the chat REPL (and `apply_chat_template`) for models that ship no template: plain
# "User:/Assistant:" turns, after the BOS token if the model has one. The system message,
# if any, comes first as a plain paragraph.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str):
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError, TemplateSyntaxError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise UserError(f"the chat template is not valid jinja2: {e}") from None


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         **variables) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return _compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError as e:
        raise UserError(f"the chat template refused these messages: {e}") from None
