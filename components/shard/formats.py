"""Record formats: detection and conversion to (prompt, chosen, rejected) text, or to a
prompt alone with its columns.

- explicit: ``{"prompt": str, "chosen": str, "rejected": str, "margin"?: float}`` (TRL)
- implicit: ``{"chosen": str, "rejected": str}`` in Anthropic HH style; the prompt is the
  shared prefix up to and including the last ``"\\n\\nAssistant:"`` both share
- conversational: ``prompt``/``chosen``/``rejected`` as lists of ``{"role", "content"}``
  messages (or ShareGPT's ``{"from", "value"}``: ``human`` the user, ``gpt`` the
  assistant); ``prompt`` may be absent, or text beside conversations that hold the user's
  turn too: then it is the messages both share. Rendered with the tokenizer's chat
  template or the documented default; a record's ``tools`` (function schemas), its own
  ``chat_template_kwargs`` and its messages' ``tool_calls`` go to the template as TRL and
  transformers pass them
- vertex: ``{"input_text": str, "candidate_0": str, "candidate_1": str, "choice": 0|1}``
- prompt: TRL's prompt-only records, ``{"prompt": str, ...}``; conversational_prompt:
  ``{"prompt": [messages], ...}``, rendered with the generation prompt. Every other field
  (``answer``, ``solution``, ``tests``, anything) is kept as the record's columns, a JSON
  object stored with the prompt, for the reward functions that score its responses.
- prompt_completion: TRL's ``{"prompt": str, "completion": str}``; conversational_completion:
  both as message lists. The completion is the record's one response (sft's target).
- messages: TRL's conversational language-modeling records, ``{"messages": [...]}`` (its
  SFTTrainer's usual data; with a ``prompt`` that repeats the first user turn too), or
  ShareGPT's ``{"conversations": [{"from", "value"}, ...]}``:
  the last turn, the assistant's, is the completion and the turns before it the prompt.
  TRL's ``assistant_only_loss`` trains on every assistant turn; the sft stage trains on the
  last one, the earlier ones being its context.
- alpaca: ``{"instruction", "input", "output", "system"?, "history"?}`` (tatsu-lab/alpaca's
  and its kin's), read as the conversation LLaMA-Factory makes of it, a ``messages`` record.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from components.core.data.tokenizers import Tokenizer
from components.shard.invalid import Invalid, require
from components.shard.messages import (
    alpaca_turns,
    message_list,
    record_kwargs,
    with_system_message,
)

HH_ASSISTANT = "\n\nAssistant:"
FLOAT32_MAX = 3.4028234663852886e38  # shards store the margin as a float32


@dataclasses.dataclass(frozen=True, slots=True)
class TextPair:
    """One preference pair as text, whatever format it came in (``kind`` "pair"); or a
    prompt alone with its other fields as ``columns`` (JSON) ("prompt"); or a prompt and its
    completion, as ``chosen`` ("completion")."""

    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0
    gold_reward: str | None = None
    kind: str = "pair"
    columns: str = "{}"

    @property
    def prompt_only(self) -> bool:
        return self.kind == "prompt"


PROMPT_FORMATS = ("prompt", "conversational_prompt")
COMPLETION_FORMATS = ("prompt_completion", "conversational_completion", "messages", "alpaca")
# The formats of message lists, rendered with the chat template (and the record's tools).
TEMPLATED_FORMATS = ("conversational", "conversational_prompt", "conversational_completion",
                     "messages", "alpaca")  # fmt: skip
# Fields that make a record a pair or a completion rather than a prompt alone.
RESPONSE_FIELDS = ("chosen", "rejected", "completion", "candidate_0", "candidate_1")


def detect_format(obj: dict[str, Any]) -> str | None:
    """The format an object is written in, or None."""
    if "input_text" in obj and "choice" in obj:
        return "vertex"
    if _prompt_repeats_conversation(obj):
        return "messages"
    if "prompt" in obj and not any(field in obj for field in RESPONSE_FIELDS):
        return "conversational_prompt" if isinstance(obj["prompt"], list) else "prompt"
    if "prompt" in obj and "completion" in obj and "chosen" not in obj:
        chat = isinstance(obj["prompt"], list) or isinstance(obj["completion"], list)
        return "conversational_completion" if chat else "prompt_completion"
    if isinstance(obj.get("prompt"), list) or isinstance(obj.get("chosen"), list):
        return "conversational"
    if "prompt" in obj and "chosen" in obj:
        return "explicit"
    if "chosen" in obj and "rejected" in obj:
        return "implicit"
    if isinstance(obj.get("messages", obj.get("conversations")), list):  # TRL, ShareGPT
        return "messages"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    return None


def _prompt_repeats_conversation(obj: dict[str, Any]) -> bool:
    """Whether a record is a conversation whose ``prompt`` repeats its first user turn
    (HuggingFaceH4/ultrachat_200k's and no_robots' rows: sft data, read as ``messages``).
    Any other ``prompt`` beside ``messages`` makes a prompt-only record."""
    turns, prompt = obj.get("messages"), obj.get("prompt")
    if not isinstance(prompt, str) or not isinstance(turns, list) or len(turns) < 2:
        return False
    if not all(isinstance(turn, dict) for turn in turns) or any(f in obj for f in RESPONSE_FIELDS):
        return False
    users = [turn.get("content") for turn in turns if turn.get("role") == "user"]
    return bool(users) and users[0] == prompt and turns[-1].get("role") == "assistant"


def _margin(obj: dict[str, Any]) -> float:
    if obj.get("margin") is None:
        return 0.0
    margin = require(obj, "margin", (int, float))
    try:
        value = float(margin)
    except OverflowError:  # an integer beyond any float
        value = math.inf
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        shown = (
            f"{margin!r}"
            if isinstance(margin, float)
            else f"an integer of {len(str(margin))} digits"
        )
        raise Invalid("non_finite_margin", f"margin must be a finite float32, got {shown}")
    return value


def _gold(obj: dict[str, Any]) -> str | None:
    value = obj.get("gold_reward")
    return value if isinstance(value, str) else None


def _explicit(obj: dict[str, Any]) -> TextPair:
    prompt = require(obj, "prompt", str)
    chosen = require(obj, "chosen", str)
    rejected = require(obj, "rejected", str)
    return TextPair(prompt, chosen, rejected, _margin(obj), _gold(obj))


def _implicit(obj: dict[str, Any]) -> TextPair:
    chosen = require(obj, "chosen", str)
    rejected = require(obj, "rejected", str)
    shared = _common_prefix(chosen, rejected)
    cut = shared.rfind(HH_ASSISTANT)
    if cut < 0:
        raise Invalid("no_common_prompt", f"chosen and rejected share no {HH_ASSISTANT!r} turn")
    end = cut + len(HH_ASSISTANT)
    return TextPair(chosen[:end], chosen[end:], rejected[end:], _margin(obj), _gold(obj))


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _conversational(
    obj: dict[str, Any], tokenizer: Tokenizer, template_kwargs: dict[str, Any], system: str
) -> TextPair:
    chosen = message_list(obj, "chosen")
    rejected = message_list(obj, "rejected")
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        prompt = message_list(obj, "prompt")
    else:  # implicit prompt: the messages both conversations share
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        # A text prompt beside message lists (HuggingFaceH4/ultrafeedback_binarized: both
        # lists open with the user's turn, the prompt repeats it): the shared messages are the
        # prompt, as TRL's maybe_extract_prompt takes them; if none are shared, the text is
        # the user's turn.
        if not prompt and isinstance(obj.get("prompt"), str):
            prompt = [{"role": "user", "content": obj["prompt"]}]
        if not prompt:
            raise Invalid("no_common_prompt", "chosen and rejected share no leading message")
    prompt = with_system_message(prompt, system)
    if not prompt:
        raise Invalid("empty_prompt", "prompt has no messages")
    try:
        prompt_text = tokenizer.render_chat(prompt, True, **template_kwargs)
        chosen_text = _reply_text(tokenizer, prompt, chosen, prompt_text, template_kwargs)
        rejected_text = _reply_text(tokenizer, prompt, rejected, prompt_text, template_kwargs)
    except Invalid:
        raise
    except Exception as error:  # a template can raise anything on odd input
        raise Invalid("chat_template", f"the model's chat template refused: {error}") from error
    return TextPair(prompt_text, chosen_text, rejected_text, _margin(obj), _gold(obj))


def _reply_text(
    tokenizer: Tokenizer, prompt: list, reply: list, prompt_text: str, template_kwargs: dict
) -> str:
    full = tokenizer.render_chat(prompt + reply, False, **template_kwargs)
    if not full.startswith(prompt_text):
        raise Invalid(
            "chat_template",
            "the chat template does not render the prompt as a prefix of the conversation (it "
            "moves or drops a turn once the reply follows, as Mistral's does with a system "
            "message): drop the system message, or prepend it to the first user turn",
        )
    return full[len(prompt_text) :]


def _vertex(obj: dict[str, Any]) -> TextPair:
    prompt = require(obj, "input_text", str)
    candidates = (require(obj, "candidate_0", str), require(obj, "candidate_1", str))
    choice = obj.get("choice")
    if isinstance(choice, bool) or choice not in (0, 1):
        raise Invalid("invalid_choice", f"choice must be 0 or 1, got {choice!r}")
    return TextPair(prompt, candidates[choice], candidates[1 - choice], 0.0, _gold(obj))


def _columns(obj: dict[str, Any]) -> str:
    """Every field but the prompt, as one JSON object (values JSON cannot hold, such as a
    Parquet timestamp, as their text)."""
    rest = {key: value for key, value in obj.items() if key != "prompt"}
    try:
        return json.dumps(rest, ensure_ascii=False, sort_keys=True, default=str)
    except ValueError as error:  # a NaN is JSON's, but a circular value is not
        raise Invalid("wrong_type", f"columns cannot be stored as JSON: {error}") from None


def _prompt_only(
    obj: dict[str, Any], fmt: str, tokenizer: Tokenizer, template_kwargs: dict, system: str
) -> TextPair:
    """A prompt-only record: its prompt (messages rendered up to the model's turn) and
    columns."""
    if fmt == "prompt":
        prompt = require(obj, "prompt", str)
    else:
        messages = with_system_message(message_list(obj, "prompt"), system)
        if not messages:
            raise Invalid("empty_prompt", "prompt has no messages")
        try:
            prompt = tokenizer.render_chat(messages, True, **template_kwargs)
        except Exception as error:  # a template can raise anything on odd input
            raise Invalid("chat_template", f"the model's chat template refused: {error}") from error
    return TextPair(prompt, "", "", 0.0, _gold(obj), kind="prompt", columns=_columns(obj))


def _completion(
    obj: dict[str, Any], fmt: str, tokenizer: Tokenizer, template_kwargs: dict, system: str
) -> TextPair:
    """A prompt-completion record: the completion as the one response."""
    if isinstance(obj.get("label"), bool):  # sft would learn the ones labelled bad too
        raise Invalid(
            "unknown_format", "a true/false 'label' beside the completion makes TRL's unpaired "
            "preference (KTO) record, which no stage trains on: pair its responses as prompt, "
            "chosen and rejected, or drop 'label' to train sft on every completion",
        )  # fmt: skip
    if fmt == "prompt_completion":
        prompt, completion = require(obj, "prompt", str), require(obj, "completion", str)
    else:
        if fmt in ("messages", "alpaca"):
            key = "messages" if "messages" in obj else "conversations"
            turns = alpaca_turns(obj) if fmt == "alpaca" else message_list(obj, key)
            if not turns or turns[-1]["role"] != "assistant":
                last = repr(turns[-1]["role"]) if turns else "no"
                raise Invalid(
                    "empty_response", f"messages ends with {last} turn; the last turn, the "
                    "assistant's, is the completion",
                )  # fmt: skip
            messages, reply = with_system_message(turns[:-1], system), turns[-1:]
        else:
            messages = with_system_message(message_list(obj, "prompt"), system)
            reply = message_list(obj, "completion")
        if not messages:
            raise Invalid("empty_prompt", "prompt has no messages")
        try:
            prompt = tokenizer.render_chat(messages, True, **template_kwargs)
            completion = _reply_text(tokenizer, messages, reply, prompt, template_kwargs)
        except Invalid:
            raise
        except Exception as error:  # a template can raise anything on odd input
            raise Invalid("chat_template", f"the model's chat template refused: {error}") from error
    return TextPair(prompt, completion, "", 0.0, _gold(obj), kind="completion")


def to_text_pair(
    obj: Any,
    fmt: str | None,
    tokenizer: Tokenizer,
    template_kwargs: dict | None = None,
    system_message: str = "keep",
) -> TextPair:
    """Convert a parsed object of format ``fmt`` to a TextPair, or raise Invalid;
    ``template_kwargs``: the chat template's own arguments, ``system_message``: what becomes
    of a leading system message (:func:`with_system_message`), for conversational records."""
    if not isinstance(obj, dict):
        raise Invalid("not_object", f"expected a JSON object, got {type(obj).__name__}")
    if fmt is None:
        raise Invalid("unknown_format", f"keys {sorted(obj)[:8]} match no supported format")
    kwargs = template_kwargs or {}
    if fmt in TEMPLATED_FORMATS:
        kwargs = record_kwargs(obj, kwargs)
    if fmt == "explicit":
        pair = _explicit(obj)
    elif fmt == "implicit":
        pair = _implicit(obj)
    elif fmt == "conversational":
        pair = _conversational(obj, tokenizer, kwargs, system_message)
    elif fmt in PROMPT_FORMATS:
        pair = _prompt_only(obj, fmt, tokenizer, kwargs, system_message)
    elif fmt in COMPLETION_FORMATS:
        pair = _completion(obj, fmt, tokenizer, kwargs, system_message)
    else:
        pair = _vertex(obj)
    if not pair.prompt.strip():
        raise Invalid("empty_prompt", "prompt is empty")
    if pair.prompt_only:
        _check_unicode(pair, ("prompt", "columns"))
        return pair
    if pair.kind == "completion":
        if not pair.chosen.strip():
            raise Invalid("empty_response", "completion is empty")
        _check_unicode(pair, ("prompt", "chosen"))
        return pair
    if not pair.chosen.strip() or not pair.rejected.strip():
        raise Invalid("empty_response", "chosen or rejected response is empty")
    if pair.chosen == pair.rejected:
        raise Invalid("identical_responses", "chosen and rejected are identical")
    _check_unicode(pair, ("prompt", "chosen", "rejected"))
    return pair


def _check_unicode(pair: TextPair, names: tuple[str, ...]) -> None:
    for name in names:
        try:
            getattr(pair, name).encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate escape such as "\ud800"
            raise Invalid("not_json", f"{name} is not valid Unicode: {error}") from None
