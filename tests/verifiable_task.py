"""The built-in reasoning task's inputs for tests: its prompt shards, its SFT shards and the
warm-started policy, built once per module that asks (about 12 s on 2 cores)."""

from __future__ import annotations

import dataclasses

import components.sft as sft
from components.core.data import reasoning_task
from components.shard import ShardConfig
from components.shard import run as shard_run

TOKENIZER = "builtin-arithmetic"
# The pipeline's problems with operands 0..9 (200, not 450): shorter runs for the tests.
SMALL = dataclasses.replace(reasoning_task.UNSPLIT, max_operand=9)
# Enough SFT to learn the answer format and a third of the problems (greedy 0.33 on train,
# 0.30 on eval problems).
SFT = dict(preset="tiny", steps=300, batch_size=8, max_len=0, learning_rate=3e-3,
           warmup_steps=10, eval_every=100000, save_every=100000)  # fmt: skip


def build(root) -> dict[str, str]:
    """Shards of every problem (``prompts``: a quarter held out as the eval split), of 64
    formatted solutions (``sft_shards``, split alike) and the policy trained on those
    (``sft``), under ``root``."""
    paths = {name: str(root / name) for name in ("prompts", "sft_shards", "sft")}
    reasoning_task.write_task(str(root), seed=0, sft_count=64, config=SMALL)
    shard = ShardConfig(num_shards=1, tokenizer=TOKENIZER, eval_fraction=0.25, min_eval_pairs=8)
    shard_run(shard, [str(root / reasoning_task.PROMPTS_FILE)], paths["prompts"])
    shard_run(shard, [str(root / reasoning_task.SFT_FILE)], paths["sft_shards"])
    sft.run(sft.SFTConfig(**SFT), paths["sft_shards"], paths["sft"])
    return paths
