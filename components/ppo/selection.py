"""What checkpoint selection (``select_checkpoint`` heldout) ranks each save by: the
held-out reward model's mean score of the saved policy's samples on the held-out split's
prompts, with the same keys at every save.

A save's own rollout is a poor ranking: 64 responses (the rollout batch) to prompts that
change each iteration, so on a plateau of the held-out score one rollout wanders by about
±0.1 std and the ranking picks by noise (bench_overoptimisation, biased-fast seed 1: its
rollout scores for saves 40-70 were within 0.03 std, the choice 70 kept 88% of the best gold
gain). Here every save samples the same ``select_prompts`` prompts ``select_samples`` times
with the same per-row keys (core.model.eval_sampling), so two saves differ by their policy
alone (common random numbers). The prompts are the held-out split's: the held-out model
learnt from them, and no policy stage trains on them.

Sampling is eval_sampling's (pmapped, every row its own key): the score depends on the
seed and the policy only, not on the device or host count. The held-out model is scored
in its compute dtype, as the monitors hold it; the score is its z (its eval statistics).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import nnx

from components.core.model import eval_sampling
from components.core.rewards.members import standardize

PyTree = Any
SEED_OFFSET = 7717  # keys apart from the run's other draws
SELECTION_SCORE = "overopt/selection_score"  # logged at each save, and kept with it


@dataclasses.dataclass
class HeldoutSelection:
    """Scores a policy for checkpoint selection (module docstring)."""

    policy_graph: nnx.GraphDef
    reward_graph: nnx.GraphDef
    member: int | None  # the held-out model's index in the stacked monitors (None: not stacked)
    stats: tuple[float, float]  # its eval mean and std
    prompts: eval_sampling.Prompts
    settings: eval_sampling.SamplingSettings
    samples: int
    seed: int
    batch_size: int  # rows per sampling and scoring step and host

    @classmethod
    def build(
        cls,
        shards_dir: str,
        graphs: tuple[nnx.GraphDef, nnx.GraphDef],
        member: int | None,
        stats: tuple[float, float],
        settings: eval_sampling.SamplingSettings,
        *,
        prompts: int,
        samples: int,
        prompt_len: int,
        seed: int,
        batch_size: int,
    ) -> HeldoutSelection:
        """The selection of ``prompts`` held-out-split prompts (the first, in shard order)
        sampled ``samples`` times each, scored by stacked model ``member`` (the reward graph),
        ``batch_size`` rows a step and host: the rollout's, so a chip holds no more sequences
        than the rollout's sampling, which the planner counts (pipelines/dag/phases.py)."""
        chosen = eval_sampling.split_prompts(
            shards_dir, "heldout", prompt_len=prompt_len, max_prompts=prompts
        )
        if not len(chosen.tokens):
            raise ValueError(
                f"select_prompts: {shards_dir} has no heldout-split prompts to rank checkpoints "
                "on; shard with heldout_fraction > 0 or held-out data (pipeline: heldout_reward, "
                "heldout_data_uri), or set select_prompts 0 to rank each save by its own rollout"
            )
        return cls(
            *graphs, member, stats, chosen, settings, samples, seed + SEED_OFFSET, batch_size
        )

    def score(self, policy: PyTree, members: PyTree) -> float:
        """The held-out model's mean z over the samples of ``policy``; ``members``: the
        monitors' stacked parameters (both placed, replicated: the loop's own copies, so
        nothing is placed twice)."""
        responses = eval_sampling.sample_responses(
            self.policy_graph, policy, self.prompts, settings=self.settings,
            samples_per_prompt=self.samples, seed=self.seed, batch_size=self.batch_size,
        )  # fmt: skip
        raw = eval_sampling.response_scores(
            self.reward_graph, members, self.prompts, responses, batch_size=self.batch_size,
            member=self.member,
        )  # fmt: skip
        mean, std = self.stats
        return float(np.mean(standardize(raw, {"mean": mean, "std": std})))
