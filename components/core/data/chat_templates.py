"""Chat templates: the default one and rendering a template as ``transformers`` does."""

from __future__ import annotations

import json
from typing import Any

# The documented default chat template (Jinja, as Hugging Face applies it):
# one block per message, then the assistant tag when a reply is to follow.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def render_chat_template(
    template: str, messages: list[dict[str, str]], add_generation_prompt: bool, **extra: Any
) -> str:
    """Apply a Jinja chat template the way ``transformers`` does: a sandboxed environment
    with its options, loop controls, ``tojson`` without HTML escaping, ``raise_exception``
    and ``strftime_now`` (transformers' ``chat_template_utils``; tests compare the two)."""
    import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **extra
    )
