"""The built-in reasoning task: small arithmetic problems with one verifiable answer each.

A problem is two whole numbers and an operation, asked as ``What is 7 plus 5 ?``; its
answer is the integer result (``"12"``). A policy answers ``<answer> 12 </answer>`` and the
``builtin/exact-match`` reward (``core.rewards.builtin``) scores it 1.0 when the tagged
number equals the record's ``answer`` column, else 0.0. It is sized for a tiny transformer
(2 layers, d_model 64) trained on CPU in minutes: a short SFT warm start is to teach the
answer format and part of the table, leaving GRPO room to raise exact-match on the rest.

Why it is built this way:

- Every integer the task can produce is one word of the tokenizer (``12`` is one token, not
  ``1`` ``2``), so an answer is one prediction from an embedding lookup, not carried digits.
  The word-level tokenizer splits on whitespace only (``WhitespaceSplit``), so the tags
  ``<answer>`` and ``</answer>`` stay single tokens; it decodes by joining tokens with
  spaces, and the decoded ``<answer> 12 </answer>`` is what ``extract_answer`` reads.
- The answer range is small: operands 0..9 by default, ``minus`` only where the result is
  not negative, so the defaults' answers are 0..18 (19 number tokens, 30 tokens in all).
  ``times`` is available but off by default: its 0..81 answers must be memorised one by
  one, which a model this small is unlikely to do in a short run.
- Completions are 3 tokens plus the eos the shard stage appends, so rollouts need
  ``max_new_tokens`` of about 6.

Counts with the defaults: ``plus`` has 10 x 10 = 100 problems and ``minus`` 55 (left >= right),
155 in all. The split is by problem: the 20% whose hash of ``split_seed`` and prompt ranks
lowest are held out (31), skipping any whose answer no train problem would have left (18 is
only 9 plus 9), and the other 124 are the train problems; neither the SFT nor the RL prompts
ever contain a held-out problem. The split depends on the config alone, never on the
writers' sampling seeds, so files written with different seeds agree on it.

Formats (as the shard stage reads them, ``shard.formats``):

- RL prompts: TRL prompt-only, ``{"prompt": "What is 7 plus 5 ?", "answer": "12"}``; the
  ``answer`` column goes to the reward function.
- SFT: TRL prompt-completion, ``{"prompt": "What is 7 plus 5 ?",
  "completion": "<answer> 12 </answer>"}``; the shard stage ends the completion with eos.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import random
from collections import Counter
from typing import NamedTuple

REASONING_TASK_NAME = "builtin/arithmetic-v1"
REWARD_FUNCTIONS = "builtin/exact-match"  # the reward spec GRPO scores this task with

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
PROMPT_WORDS = ("What", "is", "?")
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
SFT_COUNT = 48  # "a few formatted solutions": about 40% of the default train problems
SPLITS = ("train", "held_out")

_APPLY = {"plus": operator.add, "minus": operator.sub, "times": operator.mul, "max": max,
          "min": min}  # fmt: skip
OPERATIONS = tuple(_APPLY)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArithmeticConfig:
    """The problem set and its split: every writer and the tokenizer read the same one."""

    max_operand: int = 9  # operands are 0..max_operand
    operations: tuple[str, ...] = ("plus", "minus")
    held_out_fraction: float = 0.2  # of the problems, never in SFT or RL prompts
    split_seed: int = 0  # which problems are held out; apart from the writers' seeds

    def __post_init__(self) -> None:
        object.__setattr__(self, "operations", tuple(self.operations))
        if not 1 <= self.max_operand <= 99:
            raise ValueError(f"max_operand must be in 1..99, got {self.max_operand}")
        unknown = [op for op in self.operations if op not in _APPLY]
        if not self.operations or unknown or len(set(self.operations)) < len(self.operations):
            raise ValueError(
                f"operations must be distinct names from {OPERATIONS}, got {self.operations}"
            )
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}")


DEFAULT_CONFIG = ArithmeticConfig()


class Problem(NamedTuple):
    """One problem: ``left operation right``."""

    left: int
    operation: str
    right: int

    @property
    def prompt(self) -> str:
        return f"{PROMPT_WORDS[0]} {PROMPT_WORDS[1]} {self.left} {self.operation} {self.right} ?"

    @property
    def answer(self) -> int:
        return _APPLY[self.operation](self.left, self.right)


def format_completion(answer: int | str) -> str:
    """The formatted solution the SFT warm start teaches: ``<answer> 12 </answer>``."""
    return f"{ANSWER_OPEN} {answer} {ANSWER_CLOSE}"


def all_problems(config: ArithmeticConfig = DEFAULT_CONFIG) -> list[Problem]:
    """Every problem of the task, by operation then operands (``minus``: left >= right)."""
    span = range(config.max_operand + 1)
    return [
        Problem(left, op, right)
        for op in config.operations
        for left in span
        for right in span
        if op != "minus" or left >= right
    ]


def split_problems(
    config: ArithmeticConfig = DEFAULT_CONFIG,
) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)``: the problems whose seeded hash ranks lowest are held out, but
    never the last train problem of an answer (a token never trained on is never said)."""

    def rank(problem: Problem) -> bytes:
        return hashlib.sha256(f"{config.split_seed}:{problem.prompt}".encode()).digest()

    problems = all_problems(config)
    held_count = round(config.held_out_fraction * len(problems))
    train_per_answer = Counter(p.answer for p in problems)
    held: set[Problem] = set()
    for problem in sorted(problems, key=rank):
        if len(held) == held_count:
            break
        if train_per_answer[problem.answer] > 1:
            train_per_answer[problem.answer] -= 1
            held.add(problem)
    return [p for p in problems if p not in held], [p for p in problems if p in held]


def reasoning_vocabulary(config: ArithmeticConfig = DEFAULT_CONFIG) -> list[str]:
    """Every word the task's prompts and completions can use, whichever operations a config
    picks (one tokenizer for all of them): numbers 0..the largest any operation gives."""
    every = dataclasses.replace(config, operations=OPERATIONS)
    largest = max(max(p.left, p.right, p.answer) for p in all_problems(every))
    numbers = [str(n) for n in range(largest + 1)]
    return [*PROMPT_WORDS, *OPERATIONS, ANSWER_OPEN, ANSWER_CLOSE, *numbers]


def reasoning_tokenizer_files(config: ArithmeticConfig = DEFAULT_CONFIG) -> tuple[bytes, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the task's word-level tokenizer.

    Split on whitespace alone, so ``<answer>`` is one token; no decoder, so decoding joins
    the tokens with spaces (``<answer> 12 </answer>``). Specials as in builtin_task.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = list(SPECIAL_TOKENS)
    vocab = {token: i for i, token in enumerate(specials + reasoning_vocabulary(config))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)  # dropped when decoding
    names = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), specials, strict=True))
    return tokenizer.to_str().encode("utf-8"), json.dumps(names).encode("utf-8")


def _write_records(path: str, records: list[dict]) -> int:
    from components.core import fileio

    lines = [json.dumps(record, ensure_ascii=False) for record in records]
    fileio.write_text(path, "\n".join(lines) + ("\n" if lines else ""))
    return len(lines)


def write_prompts_jsonl(
    path: str,
    count: int,
    seed: int = 0,
    *,
    split: str = "train",
    config: ArithmeticConfig = DEFAULT_CONFIG,
) -> int:
    """Write ``count`` RL prompt records ``{"prompt", "answer"}`` of one split; returns ``count``.

    Records go through the split's problems in passes, each pass in a new seeded order: up to
    one pass every problem is distinct, beyond it each repeats about equally often.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    problems = split_problems(config)[SPLITS.index(split)]
    if count and not problems:
        raise ValueError(f"the {split!r} split is empty; raise held_out_fraction above 0")
    rng = random.Random(seed)
    chosen: list[Problem] = []
    while len(chosen) < count:
        chosen.extend(rng.sample(problems, len(problems)))
    records = [{"prompt": p.prompt, "answer": str(p.answer)} for p in chosen[:count]]
    return _write_records(path, records)


def write_sft_jsonl(
    path: str,
    count: int = SFT_COUNT,
    seed: int = 0,
    *,
    config: ArithmeticConfig = DEFAULT_CONFIG,
) -> int:
    """Write ``count`` distinct train problems with formatted solutions, TRL
    prompt-completion records ``{"prompt", "completion"}``; returns ``count``."""
    train = split_problems(config)[0]
    if not 0 <= count <= len(train):
        raise ValueError(
            f"count must be in 0..{len(train)} (the distinct train problems), got {count}"
        )
    chosen = random.Random(seed).sample(train, count)
    records = [{"prompt": p.prompt, "completion": format_completion(p.answer)} for p in chosen]
    return _write_records(path, records)


# The pipeline's problem set: the larger and the smaller of two numbers 0..14, every problem
# (450), the shard stage's eval split holding some out by prompt hash. The SFT and the RL
# records are sharded apart with the same eval_fraction, so a problem in one's eval split is
# in the other's too: neither stage trains on it. max and min, not plus and minus: on the
# demo preset, a few solutions and GRPO on the train problems (pipelines/dag/tasks.py),
# held-out greedy accuracy rose from 0.39 after sft to 0.71 (0..9: 0.52 to 0.70); for plus and minus
# GRPO learned the train problems' answers one by one and held-out accuracy stayed near
# chance (0.10 after sft, 0.13 after GRPO): the sum of two one-token numbers is a table
# these few problems do not teach, where an order of the numbers carries over.
UNSPLIT = ArithmeticConfig(operations=("max", "min"), max_operand=14, held_out_fraction=0.0)
PROMPTS_FILE, SFT_FILE = "prompts.jsonl", "sft.jsonl"


def write_task(
    folder: str, seed: int = 0, sft_count: int = 128, config: ArithmeticConfig = UNSPLIT
) -> dict[str, int]:
    """The task's two files in ``folder``: every problem once as an RL prompt record
    (``PROMPTS_FILE``) and ``sft_count`` formatted solutions (``SFT_FILE``); their counts."""
    from components.core import fileio

    problems = len(all_problems(config))
    return {
        "prompts": write_prompts_jsonl(
            fileio.join(folder, PROMPTS_FILE), problems, seed, config=config
        ),
        "solutions": write_sft_jsonl(fileio.join(folder, SFT_FILE), sft_count, seed, config=config),
    }
