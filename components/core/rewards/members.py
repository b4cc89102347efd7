"""The reward artifact's other models: a held-out reward model and ensemble members.

The reward stage writes the model PPO trains against (the proxy) at the artifact's root
and, beside it, models no stage trains against, to tell improvement from reward hacking
(Gao et al. 2022; Coste et al. 2023):

- ``heldout/``: trained on the shards' ``heldout`` split (ShardConfig.heldout_fraction),
  prompts no other stage trains on; its gain on the policy's samples beside the proxy's
  shows what the proxy's gain is worth.
- ``ensemble/<i>/`` (i = 1 … ensemble_size − 1): trained like the proxy with seed
  ``seed + i``; with the proxy they form the ensemble whose spread on the policy's
  samples is its disagreement, and whose mean − λ·std or minimum is a conservative reward.

Each is a whole reward artifact (its own ``reward_stats.json``); the proxy's
``reward_stats.json`` names them under ``members`` (paths relative to the artifact).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from components.core import fileio

STATS_FILE = "reward_stats.json"
HELDOUT = "heldout"
ENSEMBLE = "ensemble"


@dataclasses.dataclass(frozen=True, slots=True)
class Members:
    """Folders of a reward artifact's other models (absolute), each with its score stats."""

    heldout: str | None = None
    ensemble: tuple[str, ...] = ()  # without the proxy, which is the artifact itself

    @property
    def any(self) -> bool:
        return self.heldout is not None or bool(self.ensemble)

    @property
    def folders(self) -> tuple[str, ...]:
        """Every member in the order PPO and evaluate score them: held-out first."""
        return ((self.heldout,) if self.heldout else ()) + self.ensemble


def ensemble_dir(output: str, index: int) -> str:
    return fileio.join(output, ENSEMBLE, str(index))


def members_entry(heldout: bool, ensemble_size: int) -> dict[str, Any]:
    """What the proxy's reward_stats.json says of the members (relative paths)."""
    return {
        HELDOUT: HELDOUT if heldout else None,
        ENSEMBLE: [f"{ENSEMBLE}/{i}" for i in range(1, ensemble_size)],
    }


def read_stats(model_dir: str) -> dict[str, Any] | None:
    """A reward artifact's reward_stats.json, or None when it has none."""
    path = fileio.join(model_dir, STATS_FILE)
    return json.loads(fileio.read_text(path)) if fileio.exists(path) else None


def standardize(raw: Any, stats: dict[str, Any]) -> np.ndarray:
    """Raw scores of a reward model as z-scores by its eval statistics (``stats``: its
    reward_stats.json), so models on different scales compare."""
    return (np.asarray(raw, np.float64) - stats["mean"]) / max(stats["std"], 1e-6)


def reward_members(reward_dir: str) -> Members:
    """The members the reward artifact at ``reward_dir`` names (none for older artifacts,
    or a folder that is not a reward artifact); a named member that is missing is an error."""
    if not reward_dir:
        return Members()
    stats = read_stats(reward_dir) or {}
    entry = stats.get("members") or {}
    heldout = entry.get(HELDOUT)
    found = Members(
        heldout=fileio.join(reward_dir, heldout) if heldout else None,
        ensemble=tuple(fileio.join(reward_dir, path) for path in entry.get(ENSEMBLE, [])),
    )
    for folder in found.folders:
        if read_stats(folder) is None:
            raise FileNotFoundError(
                f"{reward_dir}/{STATS_FILE} names the reward model {folder}, which has no "
                f"{STATS_FILE}: the reward artifact is incomplete; run the reward stage again"
            )
    return found
