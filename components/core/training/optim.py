"""The optimizer: global-norm clipping, then AdamW on a warmup-then-decay learning rate."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from components.core.flags import field
from components.core.training import fsdp

DECAYS = ("cosine", "linear", "constant")


@dataclasses.dataclass(slots=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup from 0, then cosine, linear (both to 0) or constant."""

    learning_rate: float = field(1e-4, help="peak learning rate, reached after warmup")
    warmup_steps: int = field(100, help="steps of linear warmup from 0 to the peak rate")
    decay: Literal["cosine", "linear", "constant"] = field(
        "cosine", help="learning-rate shape after warmup: cosine or linear to 0, or constant"
    )
    total_steps: int = field(1000, help="optimizer steps in the run; the decay ends here")
    weight_decay: float = field(0.0, help="AdamW decoupled weight decay")
    max_grad_norm: float = field(1.0, help="clip gradients to this global norm")
    b1: float = field(0.9, help="Adam first-moment decay")
    b2: float = field(0.95, help="Adam second-moment decay")
    eps: float = field(1e-8, help="Adam epsilon")

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"warmup_steps must be between 0 and total_steps ({self.total_steps}), "
                f"got {self.warmup_steps}; lower warmup_steps or raise total_steps"
            )
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def make_schedule(config: OptimConfig) -> optax.Schedule:
    """The learning rate by optimizer step: 0 at step 0, the peak at ``warmup_steps``."""
    peak, warmup = config.learning_rate, config.warmup_steps
    decay_steps = max(config.total_steps - warmup, 1)
    if config.decay == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=0.0)
    elif config.decay == "linear":
        after = optax.linear_schedule(peak, 0.0, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    # join_schedules shifts ``after`` so that it starts at its own step 0 at the boundary.
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` whose norm also covers sharded chunks (fsdp.py).

    On a tree without chunks it computes exactly what optax's does.
    """

    def update(updates: optax.Updates, state: optax.EmptyState, params=None):
        del params
        norm = fsdp.global_norm(updates)
        trigger = norm < max_norm

        def clip(t: jax.Array) -> jax.Array:
            return jnp.where(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping then ``adamw`` on :func:`make_schedule`."""
    return optax.chain(
        clip_by_global_norm(config.max_grad_norm),
        optax.adamw(
            make_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
        ),
    )


def lr_at(config: OptimConfig, step: int) -> float:
    """The learning rate used by the update at optimizer step ``step`` (for logging)."""
    return float(make_schedule(config)(step))
