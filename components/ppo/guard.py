"""KL guard rails: detect a diverging policy, decide between restoring and stopping.

The adaptive KL coefficient keeps the KL near its target; the guard only catches
divergence. Every iteration the rollout measures the policy's KL to the reference (the
exact KL of each position's next-token distributions, nats per response token). A rollout
over ``kl_stop`` marks its policy as not good (it is never checkpointed); ``patience``
such rollouts in a row trip the guard, so one noisy batch of a few hundred tokens does not.
Non-finite rollout figures, a non-finite update, and a final check over ``kl_stop`` trip
at once.

On a trip the loop restores the POLICY of the last good checkpoint (the critic
keeps what it learned, the controller its state), multiplies ``kl_coef`` by
``kl_factor`` and the learning rates by ``lr_factor``, and goes on from the same
iteration: steps never go backwards, and each restoration is an event in the log.
After ``max_restores`` restorations the next trip stops the run with status
``stopped_kl_guard`` and the last good policy as its output.

The guard's state travels in every checkpoint (so a resumed run continues exactly)
and is mirrored to ``work/guard.json`` on every event for people and tools to read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any

from components.core import fileio

log = logging.getLogger(__name__)
GUARD_FILE = "guard.json"
KL_METRIC = "objective/kl_per_token"


@dataclasses.dataclass(slots=True)
class GuardState:
    """Restorations so far, the learning-rate scale they left, rollouts over in a row, events."""

    restores: int = 0
    lr_scale: float = 1.0
    over: int = 0
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_json_dict(self) -> dict[str, Any]:
        """Plain JSON, for checkpoints and guard.json."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> GuardState:
        """The state ``to_json_dict`` wrote (older files lack ``over``)."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What the guard makes of one rollout: keep the policy, and trip (with why)."""

    good: bool  # finite and within kl_stop: may be checkpointed and output
    trip: str | None  # why the run must restore (or stop) now; None to go on


class KLGuard:
    """Trip checks and the record of restorations."""

    def __init__(
        self,
        *,
        kl_stop: float,
        max_restores: int,
        lr_factor: float,
        work_dir: str,
        patience: int = 1,
        kl_factor: float = 1.0,
    ) -> None:
        self.kl_stop, self.max_restores, self.patience = kl_stop, max_restores, patience
        self.lr_factor, self.kl_factor = lr_factor, kl_factor
        self.work_dir, self.path = work_dir, fileio.join(work_dir, GUARD_FILE)
        self.state = GuardState()
        if fileio.exists(self.path):
            self.state = GuardState.from_json_dict(json.loads(fileio.read_text(self.path)))

    def judge_rollout(self, metrics: dict[str, float], *, final: bool = False) -> Verdict:
        """Whether this rollout's policy is good, and whether the run trips now.

        ``final``: the check of the policy that becomes the output, which trips at once.
        """
        bad = sorted(name for name, value in metrics.items() if not math.isfinite(value))
        if bad:
            return Verdict(good=False, trip=f"non-finite rollout metrics {bad}")
        kl = metrics[KL_METRIC]
        if kl <= self.kl_stop:
            self.state.over = 0
            return Verdict(good=True, trip=None)
        self.state.over += 1
        why = f"KL to the reference {kl:.4g} nats/token > kl_stop {self.kl_stop:g}"
        if final:
            return Verdict(good=False, trip=f"{why} at the final check")
        if self.state.over >= self.patience:
            return Verdict(good=False, trip=f"{why} in {self.state.over} rollout(s) in a row")
        return Verdict(good=False, trip=None)

    def update_trip(self, metrics: dict[str, float]) -> str | None:
        """Why this update must not be kept (a non-finite loss or gradient), or None."""
        if metrics.get("skipped", 0.0) > 0 or not math.isfinite(metrics.get("loss/total", 0.0)):
            skipped = int(metrics.get("skipped", 0))
            return f"non-finite loss or gradients in {skipped} update step(s)"
        return None

    @property
    def exhausted(self) -> bool:
        """Whether the next trip stops the run (``max_restores`` already used)."""
        return self.state.restores >= self.max_restores

    def record(
        self,
        *,
        iteration: int,
        reason: str,
        restored_to: int,
        policy_updates: int,
        stopped: bool,
        kl_coef: float,
    ) -> dict[str, Any]:
        """Log and persist one trip; returns the event. ``kl_coef``: the coefficient after it;
        ``policy_updates``: the updates the restored policy had had (``restored_to`` less the
        iterations earlier restorations undid)."""
        if not stopped:
            self.state.restores += 1
            self.state.lr_scale *= self.lr_factor
        self.state.over = 0
        event = {
            "iteration": iteration,
            "reason": reason,
            "action": "stopped" if stopped else "restored",
            "restored_to": restored_to,
            "policy_updates": policy_updates,
            "restores": self.state.restores,
            "lr_scale": self.state.lr_scale,
            "kl_coef": kl_coef,
        }
        self.state.events.append(event)
        log.warning(
            "ppo guard at iteration %d: %s; %s the policy of iteration %d (kl_coef %.4g, "
            "lr scale %.4g)", iteration, reason, event["action"], restored_to, kl_coef,
            self.state.lr_scale,
        )  # fmt: skip
        self.save()
        return event

    def save(self) -> None:
        """Write guard.json (process 0 only; every process keeps its own copy)."""
        import jax

        if jax.process_index() == 0:
            fileio.makedirs(self.work_dir)
            fileio.write_text(self.path, json.dumps(self.state.to_json_dict(), indent=2))
