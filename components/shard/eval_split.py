"""The eval split's minimum: refuse one too small to evaluate, naming the eval_fraction that fits.

sft and reward read the eval split in batches of their ``batch_size`` and stop with an
error when it cannot fill one; the shard stage refuses such a split first, before any
training. A prompt is in eval when its split position (records.split_position) is below
``eval_fraction * 2**32``, so the least eval_fraction that holds ``min_eval_pairs`` is
known exactly from the lowest-placed train prompts, which each shard reports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from components.shard.config import ShardConfig
from components.shard.records import SPLIT_SCALE

FRACTION_DECIMALS = 4


def lowest_prompts(prompt_pairs: Iterable[tuple[int, int]], min_pairs: int) -> list[list[int]]:
    """The (split position, pairs) of the lowest-placed prompts that together hold ``min_pairs``.

    What a train shard reports: the eval split could grow by no other of its prompts first.
    """
    chosen, total = [], 0
    for position, pairs in sorted(prompt_pairs):
        if total >= min_pairs:
            break
        chosen.append([position, pairs])
        total += pairs
    return chosen


def least_eval_fraction(
    eval_pairs: int, train_candidates: Iterable[tuple[int, int]], min_pairs: int
) -> float | None:
    """The least eval_fraction whose eval split holds ``min_pairs``; None when none below 1 does.

    ``train_candidates``: (split position, pairs) of train prompts, e.g. each shard's
    :func:`lowest_prompts`; the prompts now in eval stay there at any larger fraction.
    """
    total, needed = eval_pairs, 0
    for position, pairs in sorted(train_candidates):
        if total >= min_pairs:
            break
        total, needed = total + pairs, position + 1  # in eval once below fraction * 2**32
    if total < min_pairs:
        return None
    scale = 10**FRACTION_DECIMALS
    fraction = math.ceil(needed / SPLIT_SCALE * scale) / scale
    return fraction if fraction < 1.0 else None


def eval_split_error(
    eval_pairs: int, unique_prompts: int, config: ShardConfig, least_fraction: float | None
) -> str | None:
    """Why the eval split is too small for sft and reward, with the fix; None when it is not."""
    if eval_pairs >= config.min_eval_pairs:
        return None
    if least_fraction is not None:
        fix = f"Raise eval_fraction to at least {least_fraction:g} or add prompts"
    else:
        fix = "No eval_fraction below 1 holds that many pairs: add prompts"
    return (
        f"eval split has {eval_pairs} pairs ({unique_prompts} unique prompts, eval_fraction "
        f"{config.eval_fraction:g}), fewer than min_eval_pairs {config.min_eval_pairs} (one "
        "eval batch: sft and reward read the eval split in batches of their batch_size). "
        f"{fix}; with a smaller sft/reward batch_size, lower min_eval_pairs to it"
    )
