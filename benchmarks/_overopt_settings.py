"""bench_overoptimisation's settings: the reward data each draws (its annotators' biases, the
held-out model's extra pairs) and the PPO run it makes; the bench's docstring says what each
is for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from _concise_gold import WORD_COST, concise_gold

from components.core.data.builtin_task import (
    GOLD_REWARD_NAME,
    generate_pairs,
    gold_reward,
    response_words,
)
from components.shard.records import place, prompt_hash

SFT_PAIRS, EVAL_FRACTION, HELDOUT = 4000, 0.2, 0.3  # the last two: shares of the reward prompts
BIAS_WORDS, BIAS = ("very", "quite"), 4.0
LENGTH_CREDIT, KIND = 0.35, 0.5  # a word (the verbose gold charges WORD_COST), if sentiment >= KIND
CONCISE_GOLD = f"{Path(__file__).resolve().parent / '_concise_gold.py'}:concise_gold"


@dataclasses.dataclass(frozen=True)
class Setting:
    pairs: int  # of reward data
    beta: float  # of the labels' Bradley-Terry draw
    reward_steps: int
    bias: str  # the train split's annotators: "" (gold), "words" or "length" (annotator)
    save_every: int
    learning_rate: float  # of ppo
    iterations: int  # of ppo
    heldout_pairs: int = 0  # more gold-labelled pairs on the heldout split's prompts
    gold: str = GOLD_REWARD_NAME  # the evaluate stage's gold_reward spec

    @property
    def gold_fn(self) -> Callable[[str, str], float]:
        return concise_gold if self.gold == CONCISE_GOLD else gold_reward

    def about(self) -> str:
        credit = {"words": "/".join(BIAS_WORDS), "length": "length"}.get(self.bias, "")
        bias = f", the train split's annotators crediting {credit}" * bool(credit)
        gold = f", gold: sentiment less {WORD_COST:g} a word" * (self.gold == CONCISE_GOLD)
        more = f" and {self.heldout_pairs} more on the held-out prompts" * bool(self.heldout_pairs)
        return (
            f"reward models on {self.pairs} pairs{more} at beta {self.beta:g}{bias}, "
            f"{self.reward_steps} steps{gold}; ppo at {self.learning_rate:g} for {self.iterations} "
            f"iterations, saved every {self.save_every}"
        )


SETTINGS = {  # pairs, beta, reward_steps, bias, save_every, learning_rate, iterations
    "biased": Setting(1200, 10.0, 60, "words", 5, 5e-5, 100, heldout_pairs=1000),
    "biased-fast": Setting(1200, 10.0, 60, "words", 5, 7e-5, 100, heldout_pairs=1000),
    "verbose": Setting(
        1200, 10.0, 60, "length", 5, 7e-5, 100, heldout_pairs=1000, gold=CONCISE_GOLD
    ),
    "noisy": Setting(600, 3.0, 300, "", 10, 1e-4, 100),
}


def split_of(prompt: str) -> str:
    """The split the shard stage puts ``prompt`` in."""
    return place(prompt_hash(prompt), EVAL_FRACTION, 1, HELDOUT)[0]


def heldout_pairs(
    count: int, seed: int, beta: float, gold: Callable[[str, str], float], anywhere: bool = False
) -> list[dict]:
    """``count`` more pairs labelled by gold: a held-out share from another annotator pool,
    bigger than its share of the prompts. On the heldout split's prompts, or on any prompt
    if ``anywhere`` (as a user's ``heldout_data_uri`` would hold them: the shard stage puts
    them all in the heldout split). Drawn apart from the setting's pairs (another seed), so
    the train split and the proxy are unchanged."""
    drawn = generate_pairs(count * 8, seed=seed + 7919, beta=beta, annotator=gold)
    kept = (pair for pair in drawn if anywhere or split_of(pair["prompt"]) == "heldout")
    pairs = list(kept)[:count]
    if len(pairs) < count:
        raise ValueError(f"drew {len(pairs)} held-out pairs of {count}")
    return pairs


def annotator(setting: Setting) -> Callable[[str, str], float]:
    """The score the labels are drawn on: the setting's gold, plus its bias on the prompts the
    shard stage puts in train (the proxy's and the ensemble's data): ``BIAS``/6 for each of
    ``BIAS_WORDS`` ("words") or ``LENGTH_CREDIT`` a word ("length")."""

    def score(prompt: str, response: str) -> float:
        gold = setting.gold_fn(prompt, response)
        if not setting.bias or split_of(prompt) != "train":
            return gold
        words = response_words(response)
        if setting.bias == "length":  # once an answer is kind, the longer seems better
            return gold + LENGTH_CREDIT * len(words) * (gold_reward(prompt, response) >= KIND)
        return gold + BIAS * sum(word in BIAS_WORDS for word in words) / 6

    return score
