"""KL guard rails: detect a diverging policy, decide between restoring and stopping.

Every iteration the rollout measures the policy's KL to the reference (k3, nats
per response token). Above ``kl_stop``, or when the rollout metrics or the
update are not finite, the guard trips: the stage restores the last good
checkpoint (only policies that passed this check are ever checkpointed), the
learning rates are multiplied by ``restore_lr_factor``, and the run goes on.
After ``max_restores`` restorations the next trip stops the run with status
``stopped_kl_guard`` and the last good policy as its output.

The guard's own state (restorations so far, learning-rate scale, events) only
grows, so it is kept in ``work/guard.json`` next to the checkpoints and written
on every event: a restarted run picks it up whatever checkpoint it resumes from.
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
    """Restorations so far, the learning-rate scale they left, and every event."""

    restores: int = 0
    lr_scale: float = 1.0
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class KLGuard:
    """Trip checks and the persisted record of restorations."""

    def __init__(
        self, *, kl_stop: float, max_restores: int, lr_factor: float, work_dir: str
    ) -> None:
        self.kl_stop, self.max_restores, self.lr_factor = kl_stop, max_restores, lr_factor
        self.work_dir, self.path = work_dir, fileio.join(work_dir, GUARD_FILE)
        self.state = GuardState()
        if fileio.exists(self.path):
            self.state = GuardState(**json.loads(fileio.read_text(self.path)))

    def rollout_trip(self, metrics: dict[str, float]) -> str | None:
        """Why the policy that produced this rollout must not be kept, or None."""
        bad = sorted(name for name, value in metrics.items() if not math.isfinite(value))
        if bad:
            return f"non-finite rollout metrics {bad}"
        kl = metrics[KL_METRIC]
        if kl > self.kl_stop:
            return f"KL to the reference {kl:.4g} nats/token > kl_stop {self.kl_stop:g}"
        return None

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

    def record(self, *, iteration: int, reason: str, restored_to: int, stopped: bool) -> None:
        """Log and persist one trip; a restoration also lowers the learning-rate scale."""
        if not stopped:
            self.state.restores += 1
            self.state.lr_scale *= self.lr_factor
        event = {
            "iteration": iteration,
            "reason": reason,
            "action": "stopped" if stopped else "restored",
            "restored_to": restored_to,
            "restores": self.state.restores,
            "lr_scale": self.state.lr_scale,
        }
        self.state.events.append(event)
        log.warning(
            "ppo guard at iteration %d: %s; %s (checkpoint of iteration %d, lr scale %.4g)",
            iteration, reason, event["action"], restored_to, self.state.lr_scale,
        )  # fmt: skip
        self.save()

    def save(self) -> None:
        """Write the guard state (process 0 only; every process keeps its own copy)."""
        import jax

        if jax.process_index() == 0:
            fileio.makedirs(self.work_dir)
            fileio.write_text(self.path, json.dumps(dataclasses.asdict(self.state), indent=2))
