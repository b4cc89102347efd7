"""Chat templates: the default one, a model folder's own, and rendering a template as
``transformers`` does."""

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


def folder_template(
    config: dict[str, Any], side: dict[str, bytes]
) -> tuple[str | None, dict[str, bytes]]:
    """A Hugging Face folder's chat template, and its side files as a tokenizer carries them.

    ``chat_template.jinja`` (transformers 5) wins over ``tokenizer_config.json``'s
    ``chat_template`` (a string, or named templates: the "default" one), as in transformers.
    A folder with neither but a processor's ``chat_template.json`` (multimodal releases saved
    by transformers 4.4x-4.5x, whose processor applies that template) takes it, carried on as
    ``chat_template.jinja`` so that an export ships it where a tokenizer reads it.
    """
    side = dict(side)
    legacy = side.pop("chat_template.json", None)
    if "chat_template.jinja" in side:
        return side["chat_template.jinja"].decode("utf-8"), side
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not template and legacy:
        try:
            template = json.loads(legacy)["chat_template"]
            if not isinstance(template, str):
                raise TypeError(template)
        except (ValueError, TypeError, KeyError):
            raise ValueError(
                'chat_template.json is not {"chat_template": "..."}: fix or delete the file'
            ) from None
        if template:
            side["chat_template.jinja"] = template.encode("utf-8")
    return template, side
