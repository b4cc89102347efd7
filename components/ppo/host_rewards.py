"""Reward functions in the rollouts: a rollout's responses decoded and scored on the host.

Between the rollout's two device programs (rollout.make_rollout_phases) the host reads
the sampled tokens back, decodes each response up to its stop token, and calls the reward
functions (components.core.rewards) as TRL's GRPOTrainer calls its ``reward_funcs``:
``prompts`` (the prompt's text as the shard stage stored it: a conversational prompt is
its chat template's rendering, not the messages), ``completions`` (strings; for
conversational data one assistant message each, as TRL passes them), ``completion_ids``
(the response's tokens up to and with its stop token, TRL's masked ids),
``max_completion_length`` and the prompt records' other columns. Each host scores its own
devices' rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from components.core.data.tokenizers import Tokenizer
from components.core.rewards.completions import as_completion, columns_of, completion
from components.core.rewards.scoring import RewardBatch, RewardScorer


class HostRewards:
    """Decodes a rollout's responses and scores them with ``scorer``'s functions."""

    def __init__(
        self,
        scorer: RewardScorer,
        tokenizer: Tokenizer,
        *,
        conversational: bool,
        max_new_tokens: int,
    ) -> None:
        self.scorer, self.tokenizer = scorer, tokenizer
        self.conversational, self.max_new_tokens = conversational, max_new_tokens

    @property
    def functions(self) -> list:
        return self.scorer.functions

    def __call__(
        self, texts: Mapping[str, np.ndarray], tokens: np.ndarray, mask: np.ndarray
    ) -> RewardBatch:
        """Rewards of rows ``tokens`` [N, T] (``mask`` [N, T]), whose prompts' texts and
        columns are ``texts`` (prompts.TEXT_KEYS, N rows)."""
        decoded, ids = zip(
            *(completion(self.tokenizer, t, m) for t, m in zip(tokens, mask, strict=True)),
            strict=True,
        )
        completions = [as_completion(text, self.conversational) for text in decoded]
        columns = columns_of([json.loads(c) for c in texts["columns"]])
        return self.scorer.score(
            list(texts["prompt_text"]), completions, columns,
            completion_ids=ids, max_completion_length=self.max_new_tokens,
        )  # fmt: skip
