"""KL-penalty coefficient controllers as pure state + update, checkpointable as a pytree."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from components.ppo.config import DEFAULT_KL_TARGET

KLControllerKind = Literal["fixed", "adaptive"]

DEFAULT_KL_HORIZON = 10_000.0

# Ziegler et al. (2019): the proportional error is clipped so one noisy batch moves kl_coef
# by at most 20% × n_steps / horizon.
_MAX_PROPORTIONAL_ERROR = 0.2


@struct.dataclass
class KLControllerState:
    """The KL coefficient and the settings that drive its updates."""

    kl_coef: jax.Array
    target: jax.Array
    horizon: jax.Array
    # Static: it selects the update rule at trace time and is not a checkpointed array.
    kind: str = struct.field(pytree_node=False, default="fixed")

    def to_json_dict(self) -> dict[str, float | str]:
        """Plain floats and the kind, for a JSON checkpoint."""
        return {
            "kind": self.kind,
            "kl_coef": float(self.kl_coef),
            "target": float(self.target),
            "horizon": float(self.horizon),
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, float | str]) -> KLControllerState:
        """The state written by ``to_json_dict``."""
        return init_kl_controller(
            str(data["kind"]),
            float(data["kl_coef"]),
            target=float(data["target"]),
            horizon=float(data["horizon"]),
        )


def init_kl_controller(
    kind: KLControllerKind | str,
    kl_coef: float,
    target: float = DEFAULT_KL_TARGET,
    horizon: float = DEFAULT_KL_HORIZON,
) -> KLControllerState:
    """A controller at ``kl_coef``; ``target`` (per token, as PPOConfig's) and ``horizon``
    (sequences) drive 'adaptive'."""
    if kind not in ("fixed", "adaptive"):
        raise ValueError(f"kind={kind!r} is not a KL controller; use 'fixed' or 'adaptive'.")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0 (0 disables the KL penalty).")
    if kind == "adaptive" and (target <= 0 or horizon <= 0):
        raise ValueError(
            f"the adaptive KL controller needs target > 0 and horizon > 0, got "
            f"target={target}, horizon={horizon}; set both to positive values."
        )
    return KLControllerState(
        kl_coef=jnp.asarray(kl_coef, jnp.float32),
        target=jnp.asarray(target, jnp.float32),
        horizon=jnp.asarray(horizon, jnp.float32),
        kind=kind,
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
    proportional_error = jnp.clip(
        observed_kl / state.target - 1.0, -_MAX_PROPORTIONAL_ERROR, _MAX_PROPORTIONAL_ERROR
    )
    multiplier = 1.0 + proportional_error * n_steps / state.horizon
    return state.replace(kl_coef=state.kl_coef * multiplier)
