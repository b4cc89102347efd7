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
  e = clip(log(KL / target), ±1), in velocity form: Δ log β = k_p · (e_t − e_{t−1}) +
  k_i · e_t. The proportional term answers a rising KL at once and damps the integral's
  oscillation (Stooke, Achiam and Abbeel, "Responsive Safety in Reinforcement Learning by
  PID Lagrangian Methods", 2020, show the same for Lagrange multipliers); working in log
  space makes a step a factor, whatever the coefficient's scale. The error starts at −1: the
  policy starts at the reference, a KL of 0. Until the KL first reaches the target the
  integral term is off, so the coefficient follows the proportional term alone:
  kl_coef · exp(k_p · (e + 1)), never below its start, rising as the KL nears the target.
  The integral would wind it down while the policy has not moved yet (KL ≈ 0 during the
  learning-rate warm-up), just before its KL takes off; a rule that let the coefficient only
  rise instead would ratchet it up on every upward blip of a noisy KL (at k_p = 2 it took
  RLOO's from 0.5 to 5.0 on the demo before the KL had once reached the target, which held
  the KL at a quarter of it).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from components.ppo.config import DEFAULT_KL_TARGET

KLControllerKind = Literal["fixed", "adaptive", "pid"]
KINDS = ("fixed", "adaptive", "pid")

DEFAULT_KL_HORIZON = 10_000.0

# Ziegler et al. (2019): the proportional error is clipped so one noisy batch moves kl_coef
# by at most 20% × n_steps / horizon.
_MAX_PROPORTIONAL_ERROR = 0.2
# pid: the gains (per rollout) and the clip of the log error; see the module docstring.
DEFAULT_PID_GAINS = (1.0, 0.3)
_MAX_LOG_ERROR = 1.0


@struct.dataclass
class KLControllerState:
    """The KL coefficient and the settings that drive its updates."""

    kl_coef: jax.Array
    target: jax.Array
    horizon: jax.Array
    # Static: it selects the update rule at trace time and is not a checkpointed array.
    kind: str = struct.field(pytree_node=False, default="fixed")
    # pid only: the gains, the last error (−1 before the first: a KL of 0) and whether the
    # KL has reached the target yet (1.0) or not (0.0).
    gains: tuple[float, float] = struct.field(pytree_node=False, default=DEFAULT_PID_GAINS)
    last_error: jax.Array = struct.field(
        default_factory=lambda: jnp.asarray(-_MAX_LOG_ERROR, jnp.float32)
    )
    reached: jax.Array = struct.field(default_factory=lambda: jnp.zeros((), jnp.float32))

    def to_json_dict(self) -> dict[str, float | str | list[float]]:
        """Plain floats and the kind, for a JSON checkpoint."""
        return {
            "kind": self.kind,
            "kl_coef": float(self.kl_coef),
            "target": float(self.target),
            "horizon": float(self.horizon),
            "gains": list(self.gains),
            "last_error": float(self.last_error),
            "reached": float(self.reached),
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> KLControllerState:
        """The state written by ``to_json_dict``."""
        state = init_kl_controller(
            str(data["kind"]),
            float(data["kl_coef"]),
            target=float(data["target"]),
            horizon=float(data["horizon"]),
            gains=tuple(data.get("gains", DEFAULT_PID_GAINS)),
        )
        return state.replace(
            last_error=jnp.asarray(data.get("last_error", -_MAX_LOG_ERROR), jnp.float32),
            reached=jnp.asarray(data.get("reached", 0.0), jnp.float32),
        )


def init_kl_controller(
    kind: KLControllerKind | str,
    kl_coef: float,
    target: float = DEFAULT_KL_TARGET,
    horizon: float = DEFAULT_KL_HORIZON,
    gains: tuple[float, float] = DEFAULT_PID_GAINS,
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
    """Δ log β = k_p · (e − e_last) + k_i · e, e = clip(log(KL / target), ±1); no integral
    term before the KL first reaches the target."""
    k_p, k_i = state.gains
    # A KL of 0 (a policy that has not moved; a k1 estimate can even be < 0) is the clip's low end.
    floor = state.target * jnp.exp(-_MAX_LOG_ERROR)
    error = jnp.clip(
        jnp.log(jnp.maximum(observed_kl, floor) / state.target), -_MAX_LOG_ERROR, _MAX_LOG_ERROR
    )
    reached = jnp.maximum(state.reached, (observed_kl >= state.target).astype(jnp.float32))
    step = k_p * (error - state.last_error) + k_i * error * reached
    return state.replace(kl_coef=state.kl_coef * jnp.exp(step), last_error=error, reached=reached)
