"""From one input line to a tokenized, placed pair or a rejection.

The same functions serve the Beam job, ``alignpipe data validate`` and the
plain-Python baseline of the benchmark, so all three agree record for record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from typing import Any

from components.core.data import tfrecord
from components.core.data.tokenizers import Tokenizer
from components.shard.config import ShardConfig
from components.shard.formats import Invalid, TextPair, to_text_pair
from components.shard.invalid import renamed


@dataclasses.dataclass(frozen=True, slots=True)
class TokenPair:
    """A validated, tokenized pair with its place in the output."""

    text: TextPair
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    truncated: bool
    prompt_hash: int
    split: str
    shard: int
    source: str
    line: int

    @property
    def dedupe_key(self) -> bytes:
        """Identity for exact-duplicate removal: same prompt, chosen and rejected text (a
        prompt-only record: same prompt and columns)."""
        text = self.text
        parts = (text.prompt, text.chosen, text.rejected)
        if text.prompt_only:  # the pairs' key is as it was: shards keep their order
            parts = (*parts, text.columns)
        return hashlib.sha256("\x00".join(parts).encode("utf-8")).digest()


@dataclasses.dataclass(frozen=True, slots=True)
class Rejection:
    """An input record that failed validation, kept with everything needed to fix it."""

    source: str
    line: int
    reason: str
    detail: str
    raw: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)


def normalize_prompt(prompt: str) -> str:
    """The prompt as hashed: Unicode NFKC with runs of whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", prompt).split())


def prompt_hash(prompt: str) -> int:
    """A stable 63-bit hash of the normalized prompt (sha256; never Python's ``hash()``)."""
    digest = hashlib.sha256(normalize_prompt(prompt).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


SPLIT_SCALE = 2**32


def split_position(hash_value: int) -> int:
    """A prompt's place in [0, 2**32): it is in eval when below ``eval_fraction * 2**32``,
    in heldout when at or above ``(1 - heldout_fraction) * 2**32``."""
    return hash_value & 0xFFFFFFFF


def place(
    hash_value: int, eval_fraction: float, num_shards: int, heldout_fraction: float = 0.0
) -> tuple[str, int]:
    """Split and shard of a prompt hash: independent bits pick each. Eval takes the lowest
    positions and heldout the highest, so either fraction can change without moving a
    prompt between the other split and train."""
    position = split_position(hash_value)
    split = "train"
    if position < eval_fraction * SPLIT_SCALE:
        split = "eval"
    elif heldout_fraction and position >= (1.0 - heldout_fraction) * SPLIT_SCALE:
        split = "heldout"
    return split, (hash_value >> 32) % num_shards


def response_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A response's ids, ending as the model ends a turn: a chat template's rendering ends
    with its end-of-turn token (one of the tokenizer's ``stop_ids``: Gemma's
    ``<end_of_turn>``, Qwen's ``<|im_end|>``, Mistral's ``</s>``), and the response ends
    there: the separator the template writes after it is not the model's to say. A response
    without a stop token (plain text) gets eos. So a policy is taught to stop where its
    sampler stops it, not to say ``<end_of_turn><eos>``."""
    ids = tokenizer.encode(text)
    stops = set(tokenizer.stop_ids)
    last = max((i for i, token in enumerate(ids) if token in stops), default=-1)
    if last >= 0 and not tokenizer.decode(ids[last + 1 :]).strip():
        return ids[: last + 1]
    return ids + [tokenizer.eos_id]


def tokenize(
    pair: TextPair, tokenizer: Tokenizer, config: ShardConfig
) -> tuple[list, list, list, bool]:
    """Token ids of prompt (bos first) and responses (ending as the template ends a turn, or
    with eos), cut or refused when too long."""
    prompt = tokenizer.encode_prompt(pair.prompt)
    if pair.prompt_only:
        return _prompt_alone(prompt, tokenizer, config)
    chosen = response_ids(tokenizer, pair.chosen)
    # A completion record has one response: rejected stays empty.
    rejected = response_ids(tokenizer, pair.rejected) if pair.kind == "pair" else []
    limits = (config.max_prompt_tokens, config.max_response_tokens, config.max_response_tokens)
    lengths = (len(prompt), len(chosen), len(rejected))
    if all(n <= cap for n, cap in zip(lengths, limits, strict=True)):
        return prompt, chosen, rejected, False
    if config.too_long == "reject":
        raise Invalid(
            "too_long",
            f"prompt/chosen/rejected have {lengths} tokens; limits are {limits} "
            "(raise max_prompt_tokens/max_response_tokens or use too_long=truncate)",
        )
    keep = config.max_prompt_tokens
    if len(prompt) > keep:  # the prompt's end is what the response answers
        head = prompt[:1] if tokenizer.bos_id is not None else []
        prompt = head + prompt[len(prompt) - (keep - len(head)) :]
    chosen, rejected = chosen[: config.max_response_tokens], rejected[: config.max_response_tokens]
    if pair.kind == "pair" and chosen == rejected:
        raise Invalid("identical_responses", "chosen and rejected are identical after truncation")
    return prompt, chosen, rejected, True


def _prompt_alone(
    prompt: list[int], tokenizer: Tokenizer, config: ShardConfig
) -> tuple[list, list, list, bool]:
    """A prompt-only record's ids: the prompt, cut at its start (bos kept) or refused when
    too long; no responses."""
    keep = config.max_prompt_tokens
    if len(prompt) <= keep:
        return prompt, [], [], False
    if config.too_long == "reject":
        raise Invalid(
            "too_long",
            f"the prompt has {len(prompt)} tokens; the limit is {keep} (raise "
            "max_prompt_tokens or use too_long=truncate)",
        )
    head = prompt[:1] if tokenizer.bos_id is not None else []
    return head + prompt[len(prompt) - (keep - len(head)) :], [], [], True


def process_object(
    obj: Any, fmt: str | None, source: str, line: int, tokenizer: Tokenizer, config: ShardConfig
) -> TokenPair:
    """Validate and tokenize one parsed record and place it; raises Invalid."""
    obj = renamed(obj, config.column_map())
    pair = to_text_pair(obj, fmt, tokenizer, config.template_kwargs(), config.system_message)
    prompt_ids, chosen_ids, rejected_ids, truncated = tokenize(pair, tokenizer, config)
    hash_value = prompt_hash(pair.prompt)
    split, shard = place(
        hash_value, config.eval_fraction, config.num_shards, config.heldout_fraction
    )
    return TokenPair(
        pair,
        prompt_ids,
        chosen_ids,
        rejected_ids,
        truncated,
        hash_value,
        split,
        shard,
        source,
        line,
    )


def parse_json(raw: str) -> Any:
    """The JSON value of one line, or Invalid('not_json')."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:  # ValueError: JSONDecodeError, or an
        # integer longer than Python converts (4300 digits)
        raise Invalid("not_json", f"not valid JSON: {error}") from None


def process_item(
    item: tuple[int, str, Any, str | None], source: str, tokenizer: Tokenizer, config: ShardConfig
) -> TokenPair | Rejection:
    """One item of a source bundle to a TokenPair or a Rejection; never raises Invalid."""
    line, raw, obj, fmt = item
    try:
        if isinstance(obj, Invalid):
            raise obj
        if obj is None:
            obj = parse_json(raw)
        return process_object(obj, fmt, source, line, tokenizer, config)
    except Invalid as invalid:
        return Rejection(source, line, invalid.reason, invalid.detail, raw)


def encode_example(pair: TokenPair) -> bytes:
    """The ``tf.train.Example`` of a pair, serialized (features as in ARCHITECTURE.md); of a
    prompt-only record, its prompt and columns (JSON)."""
    if pair.text.prompt_only:
        return tfrecord.encode_example(
            {
                "prompt_ids": ("int64", pair.prompt_ids),
                "prompt": ("bytes", [pair.text.prompt.encode("utf-8")]),
                "columns": ("bytes", [pair.text.columns.encode("utf-8")]),
                "prompt_hash": ("int64", [pair.prompt_hash]),
            }
        )
    return tfrecord.encode_example(
        {
            "prompt_ids": ("int64", pair.prompt_ids),
            "chosen_ids": ("int64", pair.chosen_ids),
            "rejected_ids": ("int64", pair.rejected_ids),
            "prompt": ("bytes", [pair.text.prompt.encode("utf-8")]),
            "chosen": ("bytes", [pair.text.chosen.encode("utf-8")]),
            "rejected": ("bytes", [pair.text.rejected.encode("utf-8")]),
            "margin": ("float", [pair.text.margin]),
            "prompt_hash": ("int64", [pair.prompt_hash]),
        }
    )


def decode_example(data: bytes) -> dict[str, Any]:
    """A serialized pair back as a dict of Python values (for tests and tools)."""
    from tensorflow.core.example import example_pb2

    example = example_pb2.Example.FromString(data)
    feature = example.features.feature
    out: dict[str, Any] = {}
    for key in ("prompt_ids", "chosen_ids", "rejected_ids", "prompt_hash"):
        if key in feature:
            out[key] = list(feature[key].int64_list.value)
    for key in ("prompt", "chosen", "rejected"):
        if key in feature:
            out[key] = feature[key].bytes_list.value[0].decode("utf-8")
    if "columns" in feature:  # a prompt-only record
        out["columns"] = json.loads(feature["columns"].bytes_list.value[0].decode("utf-8"))
    else:
        out["margin"] = feature["margin"].float_list.value[0]
    out["prompt_hash"] = out["prompt_hash"][0]
    return out
