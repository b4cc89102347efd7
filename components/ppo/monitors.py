"""Over-optimisation monitors: the reward artifact's held-out model and ensemble on rollouts.

The policy is trained to please one reward model (the proxy). The reward stage can train
others beside it (core/rewards/members.py): a held-out model on prompts no stage trains on, and
ensemble members with other seeds. Every rollout, each scores the same responses (one
network at a time, ``lax.map``), standardized by its own eval statistics (z-scores, so
models of different scales compare), and the rollout logs

- ``overopt/proxy_score`` and ``overopt/heldout_score``: the mean z of the proxy and of
  the held-out model; the loop turns them into gains over the first rollout's (the
  reference's) and their gap, ``overopt/gap`` = proxy gain − held-out gain: a proxy
  climbing away from the held-out model is being gamed (Gao et al. 2022);
- ``overopt/ensemble_std``: the mean over responses of the ensemble's std (proxy and
  members): its disagreement, which rises where the policy leaves the data the models
  agree on (Coste et al. 2023; Eisenstein et al. 2023).

``conservative_reward`` trains against the ensemble's mean, minimum (Coste et al.'s WCO)
or mean − λ·std (UWO) instead of the proxy alone; the held-out model is never trained
against. The combination is made in z and mapped back to the proxy's raw scale, so the
run's score normalization (score_norm) applies to it as to the proxy's scores.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from components.core.model import scoring

PyTree = Any
AXIS = "data"


class Monitors(NamedTuple):
    """The members' static facts (part of the compiled rollout's key)."""

    proxy: tuple[float, float]  # the proxy's eval mean and std
    members: tuple[tuple[float, float], ...]  # each member's, held-out first
    heldout: bool  # whether members[0] is the held-out model
    conservative: str = ""  # PPOConfig.conservative_reward
    weight: float = 1.0  # its λ

    @property
    def ensemble(self) -> tuple[int, ...]:
        """Indices in ``members`` of the ensemble's members (the proxy is the ensemble's 0th)."""
        return tuple(range(int(self.heldout), len(self.members)))


def member_scores(graphdef: nnx.GraphDef, stacked: PyTree, batch: dict) -> jax.Array:
    """Raw scores [M, B] of every member (params stacked on a leading axis), one at a time."""
    return lax.map(lambda params: scoring.sequence_scores(graphdef, params, batch), stacked)


def _z(raw: jax.Array, stats: tuple[float, float]) -> jax.Array:
    mean, std = stats
    return (raw - mean) / max(std, 1e-6)


def monitor(
    proxy_raw: jax.Array, members_raw: jax.Array, spec: Monitors
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The raw scores to train on [B] (the proxy's, or the conservative combination in its
    scale) and the monitors' figures, averaged over every device."""
    proxy = _z(proxy_raw, spec.proxy)
    figures = {"overopt/proxy_score": jnp.mean(proxy)}
    if spec.heldout:
        figures["overopt/heldout_score"] = jnp.mean(_z(members_raw[0], spec.members[0]))
    train = proxy_raw
    if spec.ensemble:
        zs = jnp.stack(
            [proxy, *(_z(members_raw[i], spec.members[i]) for i in spec.ensemble)]
        )  # [K, B]
        std = jnp.std(zs, axis=0, ddof=1)
        figures["overopt/ensemble_std"] = jnp.mean(std)
        combined = {
            "mean": lambda: jnp.mean(zs, axis=0),
            "min": lambda: jnp.min(zs, axis=0),
            "mean-std": lambda: jnp.mean(zs, axis=0) - spec.weight * std,
        }
        if spec.conservative:
            mean, scale = spec.proxy
            train = mean + max(scale, 1e-6) * combined[spec.conservative]()
            figures["overopt/trained_score"] = jnp.mean(combined[spec.conservative]())
    return train, {name: lax.pmean(value, AXIS) for name, value in figures.items()}


def stack(trees: list[PyTree]) -> PyTree:
    """The members' parameter trees stacked on a new leading axis (same structure each)."""
    return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *trees)


PROXY_SCORE = "overopt/proxy_score"
HELDOUT_SCORE = "overopt/heldout_score"


class OveroptTracker:
    """The loop's host-side view of the monitors, checkpointed with the run: the first
    rollout's scores (the reference policy's, from which gains are counted) and the early
    stop (``heldout_patience``, ``heldout_tolerance``).

    The stop compares averages over the last ``patience`` rollouts, never one rollout with
    the best one: on a plateau one rollout's held-out score wanders (about ±0.1 std on the
    built-in task), and "below its best for N rollouts" then held after every noisy best
    (bench_overoptimisation: the three runs of its noisy setting, none gamed, stopped at
    iteration 11-20 with N = 3, at 49-67 with N = 20). A fall of more than ``tolerance``
    stds of the averaged score is not noise.
    """

    def __init__(self, patience: int, heldout: bool, tolerance: float = 0.2) -> None:
        self.patience, self.heldout, self.tolerance = patience, heldout, tolerance
        self.reference: dict[str, float] | None = None
        self.window: list[list[float]] = []  # the last `patience` (held-out, proxy) scores
        self.best: float | None = None  # the held-out average's best so far ...
        self.best_iteration = -1  # ... the iteration its window ended at ...
        self.proxy_at_best: float | None = None  # ... and the proxy's average then

    def gains(self, rollout: dict[str, float]) -> dict[str, float]:
        """Proxy and held-out gains over the reference's rollout, and their gap."""
        scores = {k: rollout[k] for k in (PROXY_SCORE, HELDOUT_SCORE) if k in rollout}
        if self.reference is None:
            self.reference = scores
        gains = {"overopt/proxy_gain": scores[PROXY_SCORE] - self.reference[PROXY_SCORE]}
        if self.heldout:
            gains["overopt/heldout_gain"] = scores[HELDOUT_SCORE] - self.reference[HELDOUT_SCORE]
            gains["overopt/gap"] = gains["overopt/proxy_gain"] - gains["overopt/heldout_gain"]
        return gains

    def observe(self, iteration: int, rollout: dict[str, float]) -> bool:
        """Take a good policy's rollout; whether the run is to stop: the held-out score
        averaged over the last ``patience`` rollouts is more than ``tolerance`` below its
        best such average, while the proxy's average is above its value at that best."""
        if not (self.heldout and self.patience):
            return False
        latest = [float(rollout[HELDOUT_SCORE]), float(rollout[PROXY_SCORE])]
        self.window = [*self.window, latest][-self.patience :]
        if len(self.window) < self.patience:
            return False
        heldout, proxy = (float(np.mean(column)) for column in zip(*self.window, strict=True))
        if self.best is None or heldout > self.best:
            self.best, self.best_iteration, self.proxy_at_best = heldout, iteration, proxy
            return False
        return self.best - heldout > self.tolerance and proxy > self.proxy_at_best

    def selection(self, rollout: dict[str, float]) -> float | None:
        """What a checkpoint of this rollout's policy is ranked by (None without held-out)."""
        return rollout.get(HELDOUT_SCORE) if self.heldout else None

    def stop_reason(self, iteration: int) -> str:
        latest = float(np.mean([heldout for heldout, _ in self.window]))
        return (
            f"stopped at iteration {iteration}: the held-out reward model's score, averaged "
            f"over the last {self.patience} rollouts (heldout_patience), is {latest:.4g}, "
            f"more than {self.tolerance:g} (heldout_tolerance) below its best average "
            f"{self.best:.4g} (to iteration {self.best_iteration}), while the proxy's average "
            f"rose above {self.proxy_at_best:.4g}: the policy is gaming it"
        )

    def state(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "window": [list(pair) for pair in self.window],  # a copy: the loop saves it later
            "best": self.best,
            "best_iteration": self.best_iteration,
            "proxy_at_best": self.proxy_at_best,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.reference = state["reference"]
        self.window = [list(pair) for pair in state.get("window", [])]
        self.best, self.best_iteration = state["best"], state["best_iteration"]
        self.proxy_at_best = state["proxy_at_best"]
