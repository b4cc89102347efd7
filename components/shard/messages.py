"""Chat messages in records: parsed as the chat template takes them (role/content, text parts,
reasoning, tool calls; ShareGPT's from/value mapped), a record's own template arguments and
tools, and what becomes of a leading system message."""

from __future__ import annotations

import json
from typing import Any

from components.shard.invalid import Invalid, require

# Parts of a message's list content that carry no text: a text-only run refuses them.
MEDIA_PARTS = ("image", "image_url", "audio", "input_audio", "video")


def content_parts(part_list: list, where: str) -> str | list[dict[str, str]]:
    """A message's list-of-parts content: one text part as its text, several as the list
    (the template joins them, as transformers passes them); media parts refused by name."""
    parts = []
    for j, part in enumerate(part_list):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise Invalid(
                "unsupported_content",
                f"{where}[{j}] is an {kind} part; alignpipe trains text-only: drop the part "
                "or keep the record out",
            )
        if kind != "text" or not isinstance(part.get("text"), str):
            raise Invalid("wrong_type", f"{where}[{j}] must be {{'type': 'text', 'text': str}}")
        parts.append({"type": "text", "text": part["text"]})
    return parts[0]["text"] if len(parts) == 1 else parts


def message_list(obj: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The messages under ``key`` as the chat template takes them: role and content (text,
    or text parts), and where given the reasoning, tool calls, tool name and call id;
    ShareGPT's messages mapped; anything else refused as ``wrong_type`` naming the message."""
    messages = require(obj, key, list)
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and "role" not in message and "from" in message:
            message = from_sharegpt(message)
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Invalid(
                "wrong_type", f"{key}[{i}] must be an object with a string 'role' (or ShareGPT's "
                "'from' and 'value')",
            )  # fmt: skip
        content = message.get("content")
        calls = message.get("tool_calls")
        if isinstance(content, list):
            content = content_parts(content, f"{key}[{i}]['content']")
        elif not isinstance(content, str) and not (content is None and calls):
            raise Invalid("wrong_type", f"{key}[{i}]['content'] must be a string or text parts")
        kept: dict[str, Any] = {"role": message["role"], "content": content}
        reasoning = message.get("reasoning_content")
        if reasoning is not None:  # Qwen3's templates render it in a <think> block
            if not isinstance(reasoning, str):
                raise Invalid("wrong_type", f"{key}[{i}]['reasoning_content'] must be a string")
            kept["reasoning_content"] = reasoning
        if calls is not None:  # an assistant's function calls (transformers' tool use)
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise Invalid("wrong_type", f"{key}[{i}]['tool_calls'] must be a list of objects")
            kept["tool_calls"] = calls
        for field in ("name", "tool_call_id"):  # a tool's reply: which tool, which call
            if isinstance(message.get(field), str):
                kept[field] = message[field]
        out.append(kept)
    return out


def record_kwargs(obj: dict[str, Any], template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The template's arguments for one record: the run's ``chat_template_kwargs``, then the
    record's own (a ``chat_template_kwargs`` column, as TRL and SmolTalk2's rows carry
    ``enable_thinking``; the record's win, being the more specific), and its ``tools``
    (function schemas, as TRL passes a ``tools`` column to ``apply_chat_template``). Either
    column may be a JSON string, as some datasets store them."""
    kwargs = dict(template_kwargs)
    for name, kind, what in (
        ("chat_template_kwargs", dict, "an object of the template's arguments"),
        ("tools", list, "a list of function schemas"),
    ):
        value = obj.get(name)
        if value is None:
            continue
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise Invalid("wrong_type", f"field {name!r} is not JSON: {error}") from error
        shaped = isinstance(value, kind)
        if shaped and kind is list:
            shaped = all(isinstance(tool, dict) for tool in value)
        if not shaped:
            raise Invalid("wrong_type", f"field {name!r} must be {what}")
        kwargs.update(value if kind is dict else {"tools": value})
    return kwargs


def alpaca_turns(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """An Alpaca record (``instruction``, ``input``, ``output``; ``system`` and ``history``
    optional) as the conversation LLaMA-Factory makes of it: the system message, each
    ``[query, answer]`` of the history, the instruction and the input joined by a newline as
    the user's turn, the output as the assistant's."""
    system = obj.get("system") or ""
    history = obj.get("history") or []
    texts = [obj.get("instruction"), obj.get("input") or "", obj.get("output"), system]
    if not all(isinstance(text, str) for text in texts):
        raise Invalid("wrong_type", "instruction, input, output and system must be strings")
    pairs = isinstance(history, list) and all(
        isinstance(turn, list | tuple) and len(turn) == 2 and all(isinstance(t, str) for t in turn)
        for turn in history
    )
    if not pairs:
        raise Invalid("wrong_type", "history must be a list of [query, answer] string pairs")
    turns = [{"role": "system", "content": system}] if system else []
    for query, answer in history:
        turns += [{"role": "user", "content": query}, {"role": "assistant", "content": answer}]
    query = "\n".join(text for text in texts[:2] if text)
    return [*turns, {"role": "user", "content": query}, {"role": "assistant", "content": texts[2]}]


# ShareGPT's speakers (``{"from": "human", "value": ...}``, as axolotl and LLaMA-Factory read
# them); any other ``from`` is taken as the role it names.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def from_sharegpt(message: dict[str, Any]) -> dict[str, Any]:
    """A ShareGPT message as a ``{"role", "content"}`` one (TRL's maybe_convert_to_chatml
    renames the keys; the speakers are mapped too, which no chat template knows)."""
    speaker = message["from"]
    role = SHAREGPT_ROLES.get(speaker, speaker) if isinstance(speaker, str) else speaker
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    return {**rest, "role": role, "content": message.get("value", message.get("content"))}


def with_system_message(prompt: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """``prompt`` with its leading system message kept, dropped, or folded into the first
    user turn as Gemma 3's template folds it (its text, a blank line, the user's text)."""
    if mode == "keep" or not prompt or prompt[0]["role"] != "system":
        return prompt
    system, rest = prompt[0], prompt[1:]
    if mode == "drop" or not rest or rest[0]["role"] != "user":
        return rest
    text = (
        system["content"]
        if isinstance(system["content"], str)
        else "".join(part["text"] for part in system["content"])
    )
    user = dict(rest[0])
    if isinstance(user["content"], str):
        user["content"] = f"{text}\n\n{user['content']}"
    else:
        user["content"] = [{"type": "text", "text": f"{text}\n\n"}, *user["content"]]
    return [user, *rest[1:]]
