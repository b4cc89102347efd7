"""KL-penalty coefficient controllers as pure state + update, checkpointable as a pytree.

Three kinds:

- ``fixed``: the coefficient never moves.
- ``adaptive``: Ziegler et al. (2019), TRL's and OpenRLHF's AdaptiveKLController: the
  coefficient is multiplied by 1 + clip(KL / target − 1, ±0.2) · n / horizon. This is
  integral control of a plant that itself integrates (the policy's KL to the reference
  accumulates its updates), so it oscillates: on the demo the KL overshot to 5× the target
  while the coefficient crawled up by at most 8% per iteration, then fell to half the target
  while the coefficient was far past its equilibrium.
- ``pid``: proportional-integral control of log(coefficient) on the error
  e = clip(log(KL / target), ±1): log β = log β₀ + k_p · (e + 1) + I, with the integral
  I = clip(I + k_i · e, ±log 20) kept as state and applied in velocity form,
  Δ log β = k_p · (e_t − e_{t−1}) + ΔI, so the guard's raise of the coefficient carries over.
  The proportional term answers a rising KL at once and damps the integral's oscillation
  (Stooke, Achiam and Abbeel, "Responsive Safety in Reinforcement Learning by PID Lagrangian
  Methods", 2020, show the same for Lagrange multipliers); working in log space makes a step
  a factor, whatever the coefficient's scale. The error starts at −1: the policy starts at
  the reference, a KL of 0, where the coefficient is β₀ (at the target, with I = 0, it is
  β₀ · e^{k_p}).

  One rule above and below the target: after its first ``integral_delay`` rollouts (5 by
  default) the integral runs both ways, whatever side of the target the KL is on. The
  policy starts at the reference, so for its first rollouts its KL is near 0 because it has
  not moved yet, not because the coefficient is too high: integrating that error from the
  first rollout wound the demo's coefficient down from 0.37 to 0.15 before the KL took off,
  and the KL then overshot to 1.76× the target (11% of rollouts after the first tenth left
  the ±50% band). A delay counted in rollouts does not depend on the error's sign. An
  earlier rule kept the integral off until the KL first reached the target, so a start whose
  equilibrium lay below β₀ · e^{k_p} never came down: the KL never reached the target, and
  the coefficient never fell below β₀. Anti-windup by clamping: the
  integral stops at ±log 20, so a long saturated error (the KL held at 0 while the
  learning rate warms up, or far above the target after a jump) winds the coefficient by
  at most a factor of 20 from where the proportional term puts it, and an error of the
  other sign undoes it in at most 2 · log 20 / k_i rollouts (20 at k_i = 0.3), where an
  unbounded integral would keep the coefficient wrong for as long as it had wound. With
  β₀ = 0.5 and k_p = 1 the equilibrium can lie anywhere in 0.07-27. The warm-up's cost is
  the wind-down before the KL takes off: on a model of the demo's KL (test_kl_control's
  integrating plant, seeds 0-5) the worst rollout after the first tenth reached 1.8× the
  target where the one-sided rule reached 1.5×, with 95% or more of them within ±50% of it
  either way.

A resumed run takes the kind, target, horizon and gains from its configuration, not from
the checkpoint, and keeps the checkpoint's coefficient, last error and integral only when
the kind is the same (``resume_kl_controller``): a changed ``kl_target`` is honoured.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from components.ppo.config import DEFAULT_KL_TARGET

log = logging.getLogger(__name__)

KLControllerKind = Literal["fixed", "adaptive", "pid"]
KINDS = ("fixed", "adaptive", "pid")

DEFAULT_KL_HORIZON = 10_000.0

# Ziegler et al. (2019): the proportional error is clipped so one noisy batch moves kl_coef
# by at most 20% × n_steps / horizon.
_MAX_PROPORTIONAL_ERROR = 0.2
# pid: the gains (per rollout) and the clip of the log error; see the module docstring.
DEFAULT_PID_GAINS = (1.0, 0.3)
_MAX_LOG_ERROR = 1.0
# pid's anti-windup: the integral moves the coefficient by at most this factor either way.
MAX_INTEGRAL_FACTOR = 20.0
_MAX_INTEGRAL = math.log(MAX_INTEGRAL_FACTOR)


@struct.dataclass
class KLControllerState:
    """The KL coefficient and the settings that drive its updates."""

    kl_coef: jax.Array
    target: jax.Array
    horizon: jax.Array
    # Static: it selects the update rule at trace time and is not a checkpointed array.
    kind: str = struct.field(pytree_node=False, default="fixed")
    # pid only: the gains, the last error (−1 before the first: a KL of 0) and the integral
    # term Σ k_i · e, clamped to ±log MAX_INTEGRAL_FACTOR.
    gains: tuple[float, float] = struct.field(pytree_node=False, default=DEFAULT_PID_GAINS)
    last_error: jax.Array = struct.field(
        default_factory=lambda: jnp.asarray(-_MAX_LOG_ERROR, jnp.float32)
    )
    integral: jax.Array = struct.field(default_factory=lambda: jnp.zeros((), jnp.float32))
    # pid only: rollouts observed so far, and how many pass before the integral acts.
    rollouts: jax.Array = struct.field(default_factory=lambda: jnp.zeros((), jnp.float32))
    integral_delay: int = struct.field(pytree_node=False, default=0)

    def to_json_dict(self) -> dict[str, float | str | list[float]]:
        """Plain floats and the kind, for a JSON checkpoint."""
        return {
            "kind": self.kind,
            "kl_coef": float(self.kl_coef),
            "target": float(self.target),
            "horizon": float(self.horizon),
            "gains": list(self.gains),
            "last_error": float(self.last_error),
            "integral": float(self.integral),
            "rollouts": float(self.rollouts),
            "integral_delay": self.integral_delay,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> KLControllerState:
        """The state written by ``to_json_dict`` (one written before the integral was state
        restores with it at 0: its coefficient holds what the integral had done)."""
        state = init_kl_controller(
            str(data["kind"]),
            float(data["kl_coef"]),
            target=float(data["target"]),
            horizon=float(data["horizon"]),
            gains=tuple(data.get("gains", DEFAULT_PID_GAINS)),
            integral_delay=int(data.get("integral_delay", 0)),
        )
        return state.replace(
            last_error=jnp.asarray(data.get("last_error", -_MAX_LOG_ERROR), jnp.float32),
            integral=jnp.asarray(data.get("integral", 0.0), jnp.float32),
            rollouts=jnp.asarray(data.get("rollouts", 0.0), jnp.float32),
        )


def init_kl_controller(
    kind: KLControllerKind | str,
    kl_coef: float,
    target: float = DEFAULT_KL_TARGET,
    horizon: float = DEFAULT_KL_HORIZON,
    gains: tuple[float, float] = DEFAULT_PID_GAINS,
    integral_delay: int = 0,
) -> KLControllerState:
    """A controller at ``kl_coef``; ``target`` (per token, as PPOConfig's) drives 'adaptive'
    with ``horizon`` (sequences) and 'pid' with ``gains`` (proportional, integral)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a KL controller; use one of {', '.join(KINDS)}.")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0 (0 disables the KL penalty).")
    if kind == "adaptive" and (target <= 0 or horizon <= 0):
        raise ValueError(
            f"the adaptive KL controller needs target > 0 and horizon > 0, got "
            f"target={target}, horizon={horizon}; set both to positive values."
        )
    if kind == "pid" and (target <= 0 or len(gains) != 2 or min(gains) < 0 or kl_coef <= 0):
        raise ValueError(
            f"the pid KL controller needs target > 0, kl_coef > 0 (it scales the coefficient) "
            f"and two gains >= 0, got target={target}, kl_coef={kl_coef}, gains={gains}."
        )
    return KLControllerState(
        kl_coef=jnp.asarray(kl_coef, jnp.float32),
        target=jnp.asarray(target, jnp.float32),
        horizon=jnp.asarray(horizon, jnp.float32),
        kind=kind,
        gains=(float(gains[0]), float(gains[1])),
        integral_delay=int(integral_delay),
    )


def raise_kl_coef(state: KLControllerState, factor: float) -> KLControllerState:
    """The state with ``kl_coef`` multiplied by ``factor`` (the guard's answer to a trip)."""
    return state.replace(kl_coef=state.kl_coef * jnp.float32(factor))


def update_kl_controller(
    state: KLControllerState, observed_kl: float | jax.Array, n_steps: int | jax.Array
) -> KLControllerState:
    """State after observing mean KL ``observed_kl`` over ``n_steps`` samples (fixed: unchanged)."""
    if state.kind == "fixed":
        return state
    if state.kind == "pid":
        return _update_pid(state, observed_kl)
    proportional_error = jnp.clip(
        observed_kl / state.target - 1.0, -_MAX_PROPORTIONAL_ERROR, _MAX_PROPORTIONAL_ERROR
    )
    multiplier = 1.0 + proportional_error * n_steps / state.horizon
    return state.replace(kl_coef=state.kl_coef * multiplier)


def _update_pid(state: KLControllerState, observed_kl: float | jax.Array) -> KLControllerState:
    """Δ log β = k_p · (e − e_last) + ΔI, I = clip(I + k_i · e, ±log 20) once
    ``integral_delay`` rollouts have passed, e = clip(log(KL / target), ±1): the same rule
    above and below the target."""
    k_p, k_i = state.gains
    # A KL of 0 (a policy that has not moved; a k1 estimate can even be < 0) is the clip's low end.
    floor = state.target * jnp.exp(-_MAX_LOG_ERROR)
    error = jnp.clip(
        jnp.log(jnp.maximum(observed_kl, floor) / state.target), -_MAX_LOG_ERROR, _MAX_LOG_ERROR
    )
    active = (state.rollouts >= state.integral_delay).astype(jnp.float32)
    integral = jnp.clip(state.integral + k_i * error * active, -_MAX_INTEGRAL, _MAX_INTEGRAL)
    step = k_p * (error - state.last_error) + (integral - state.integral)
    return state.replace(
        kl_coef=state.kl_coef * jnp.exp(step), last_error=error, integral=integral,
        rollouts=state.rollouts + 1,
    )  # fmt: skip


def resume_kl_controller(
    saved: KLControllerState, configured: KLControllerState
) -> KLControllerState:
    """The controller a resumed run goes on with: the configuration's kind, target, horizon
    and gains; the checkpoint's coefficient, last error and integral when the kind is the
    same, else the configuration's fresh controller (the other kind's state means nothing
    to this one)."""
    if saved.kind != configured.kind:
        log.warning(
            "ppo: the checkpoint's KL controller is %s, this run's %s: it starts afresh at "
            "kl_coef %.4g (the checkpoint's was %.4g)",
            saved.kind, configured.kind, float(configured.kl_coef), float(saved.kl_coef),
        )  # fmt: skip
        return configured
    was, now = _settings(saved), _settings(configured)
    changed = [f"{name} {was[name]} (now {now[name]})" for name in now if was[name] != now[name]]
    if changed:
        log.info(
            "ppo: the checkpoint's KL controller had %s; resumed with this run's",
            "; ".join(changed),
        )
    return saved.replace(
        target=configured.target, horizon=configured.horizon, gains=configured.gains,
        integral_delay=configured.integral_delay,
    )  # fmt: skip


def _settings(state: KLControllerState) -> dict[str, Any]:
    """The settings a configuration gives a controller, as plain values."""
    return {
        "target": float(state.target), "horizon": float(state.horizon), "gains": state.gains,
        "integral_delay": state.integral_delay,
    }  # fmt: skip
