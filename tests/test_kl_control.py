"""The KL coefficient's controllers: fixed, and Ziegler et al.'s adaptive one."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from components.ppo.kl_control import (
    KLControllerState,
    init_kl_controller,
    update_kl_controller,
)


def test_fixed_kl_controller_never_moves():
    """The fixed controller keeps its coefficient whatever the KL."""
    state = init_kl_controller("fixed", 0.05)
    for observed in (0.0, 100.0):
        assert float(update_kl_controller(state, observed, 256).kl_coef) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("observed_kl", "expected_error"),
    [(7.2, 0.2), (6.6, 0.1), (6.0, 0.0), (5.4, -0.1), (60.0, 0.2), (0.0, -0.2)],
)
def test_adaptive_kl_controller_follows_ziegler_with_clipped_error(observed_kl, expected_error):
    """kl_coef *= 1 + clip(KL/target − 1, ±0.2)·n_steps/horizon: up above target, down below."""
    state = init_kl_controller("adaptive", 0.1, target=6.0, horizon=1000.0)
    updated = jax.jit(update_kl_controller)(state, observed_kl, 500)
    expected = 0.1 * (1.0 + expected_error * 500 / 1000.0)
    np.testing.assert_allclose(updated.kl_coef, expected, rtol=1e-6)
    direction = np.sign(float(updated.kl_coef) - float(state.kl_coef))
    assert direction == np.sign(observed_kl - 6.0)


def test_kl_controller_state_is_a_small_checkpointable_pytree():
    """Three scalar leaves, the kind static, and a JSON round trip."""
    state = update_kl_controller(init_kl_controller("adaptive", 0.2, 6.0, 10_000.0), 9.0, 512)
    assert len(jax.tree_util.tree_leaves(state)) == 3
    restored = KLControllerState.from_json_dict(json.loads(json.dumps(state.to_json_dict())))
    assert restored.kind == "adaptive"
    np.testing.assert_allclose(restored.kl_coef, state.kl_coef)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "pid", "kl_coef": 0.1}, "'fixed' or 'adaptive'"),
        ({"kind": "fixed", "kl_coef": -0.1}, "kl_coef"),
        ({"kind": "adaptive", "kl_coef": 0.1, "target": 0.0}, "target > 0"),
    ],
)
def test_init_kl_controller_rejects_bad_settings(kwargs, message):
    """Bad settings fail with a message that names the field."""
    with pytest.raises(ValueError, match=message):
        init_kl_controller(**kwargs)
