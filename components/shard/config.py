"""The shard stage's configuration: the one place its defaults live."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Literal

from components.core.config import check_finite
from components.core.flags import field

FORMATS = (
    "auto", "explicit", "implicit", "conversational", "vertex", "prompt", "conversational_prompt",
    "prompt_completion", "conversational_completion", "messages", "alpaca",
)  # fmt: skip
SYSTEM_MESSAGES = ("keep", "fold", "drop")


@dataclasses.dataclass(slots=True, kw_only=True)
class ShardConfig:
    """How preference files become TFRecord shards."""

    format: Literal[
        "auto", "explicit", "implicit", "conversational", "vertex", "prompt",
        "conversational_prompt", "prompt_completion", "conversational_completion", "messages",
        "alpaca",
    ] = field(
        "auto",
        help="record format; 'auto' detects it per file from its first JSON object (pairs, "
        "TRL's prompt-only records for RL, or its prompt-completion or messages records for sft)",
    )  # fmt: skip
    tokenizer: str = field(
        "byte",
        help="'byte' (built-in), a Hugging Face tokenizer.json or folder, "
        "or a SentencePiece .model",
    )
    max_prompt_tokens: int = field(256, help="longest prompt in tokens (bos included)")
    max_response_tokens: int = field(
        256, help="longest chosen/rejected response in tokens (eos included)"
    )
    too_long: Literal["truncate", "reject"] = field(
        "truncate",
        help="over-long records: 'truncate' keeps the prompt's end and the responses' start; "
        "'reject' sends them to rejected/",
    )
    columns: str = field(
        "",
        help="rename each record's columns before its format is read, as datasets' "
        'rename_columns: a JSON object of old name to new, e.g. \'{"question": "prompt"}\' '
        "for openai/gsm8k (its answer column kept for builtin/exact-match) or "
        '\'{"question": "prompt", "answer": "completion"}\' to train sft on its '
        "solutions; '' = as written",
    )
    chat_template_kwargs: str = field(
        "",
        help="JSON object of the chat template's own arguments, passed to every rendering "
        "of conversational data (Qwen3: '{\"enable_thinking\": false}'); recorded in the "
        "manifest, so every later stage reads prompts rendered the same way",
    )
    system_message: Literal["keep", "fold", "drop"] = field(
        "keep",
        help="a conversation's leading system message: 'keep' it for the template, 'fold' it "
        "into the first user turn (as Gemma 3's template does; for templates without a "
        "system role, such as Gemma 2's), or 'drop' it",
    )
    num_shards: int = field(8, help="TFRecord files per split")
    eval_fraction: float = field(0.1, help="share of prompts (by prompt hash) held out for eval")
    heldout_fraction: float = field(
        0.0,
        help="share of prompts (by prompt hash, apart from eval's) in a 'heldout' split: the "
        "reward stage trains a second, held-out reward model on it, which no other stage "
        "trains on, to watch the aligned policy for reward hacking; 0 = none",
    )
    # 8: one pair for each device of an 8-device host, the least any pmapped eval reads.
    min_eval_pairs: int = field(
        8,
        help="refuse an eval split with fewer pairs; sft and reward read it in batches of their "
        "batch_size, so set it to that (0 = no check)",
    )
    max_invalid_fraction: float = field(
        0.05, help="fail the job when more than this share of input records is rejected"
    )
    num_workers: int = field(1, help="DirectRunner worker processes (other runners: ignored)")
    lines_per_bundle: int = field(
        2000, help="input lines handled together as one Beam element (amortizes per-element cost)"
    )

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits this configuration writes."""
        return ("train", "eval", "heldout") if self.heldout_fraction else ("train", "eval")

    def __post_init__(self) -> None:
        check_finite(self)
        if self.format not in FORMATS:
            raise ValueError(f"format: {self.format!r} is not one of {FORMATS}")
        if self.too_long not in ("truncate", "reject"):
            raise ValueError(f"too_long: {self.too_long!r} must be 'truncate' or 'reject'")
        if self.num_shards < 1:
            raise ValueError(f"num_shards: {self.num_shards} must be at least 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction: {self.eval_fraction} must be in [0, 1)")
        if not 0.0 <= self.heldout_fraction < 1.0 - self.eval_fraction:
            raise ValueError(
                f"heldout_fraction: {self.heldout_fraction} must be in [0, 1 - eval_fraction "
                f"{self.eval_fraction:g}): some prompts must stay to train on"
            )
        if self.min_eval_pairs < 0:
            raise ValueError(f"min_eval_pairs: {self.min_eval_pairs} must be >= 0 (0 = no check)")
        if not 0.0 <= self.max_invalid_fraction <= 1.0:
            raise ValueError(f"max_invalid_fraction: {self.max_invalid_fraction} must be in [0, 1]")
        for name in ("max_prompt_tokens", "max_response_tokens"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}: {getattr(self, name)} must be at least 2 tokens")
        self.template_kwargs()  # refuses what is not a JSON object
        self.column_map()
        if self.system_message not in SYSTEM_MESSAGES:
            raise ValueError(
                f"system_message: {self.system_message!r} must be one of {SYSTEM_MESSAGES}"
            )
        if self.num_workers < 1:
            raise ValueError(f"num_workers: {self.num_workers} must be at least 1")
        if self.lines_per_bundle < 1:
            raise ValueError(f"lines_per_bundle: {self.lines_per_bundle} must be at least 1")

    def column_map(self) -> dict[str, str]:
        """``columns`` as a dict of old name to new (``{}`` when unset), or a ValueError."""
        return dict(_column_map(self.columns))

    def template_kwargs(self) -> dict:
        """``chat_template_kwargs`` as a dict (``{}`` when unset), or a ValueError."""
        return parse_template_kwargs(self.chat_template_kwargs)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> tuple:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(
            f"chat_template_kwargs: {text!r} must be a JSON object, such as "
            "'{\"enable_thinking\": false}'"
        )
    return tuple(value.items())


def parse_template_kwargs(text: str) -> dict:
    """A chat template's arguments from their JSON text ('' = none), parsed once per text:
    the shard stage asks for them with every record."""
    return dict(_parsed(text)) if text.strip() else {}


@functools.lru_cache(maxsize=8)
def _column_map(columns: str) -> tuple[tuple[str, str], ...]:
    """``columns`` (ShardConfig.columns) parsed and checked once: each record renames by it."""
    if not columns.strip():
        return ()
    try:
        found = json.loads(columns)
    except ValueError as error:
        raise ValueError(f"columns: not JSON ({error}); give an object such as "
                         '{"question": "prompt"}') from None  # fmt: skip
    if not isinstance(found, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in found.items()
    ):
        raise ValueError(f"columns: {columns!r} must map column names to new names")
    if len(set(found.values())) < len(found):
        raise ValueError(f"columns: {columns!r} gives two columns the same new name")
    return tuple(found.items())
