"""Optimizer config validation and learning-rate schedules."""

from __future__ import annotations

import pytest

from components.core.training.optim import OptimConfig, lr_at, make_optimizer


def test_warmup_then_cosine():
    config = OptimConfig(learning_rate=1e-3, warmup_steps=10, total_steps=110, decay="cosine")
    assert lr_at(config, 0) == 0.0
    assert lr_at(config, 5) == pytest.approx(5e-4)
    assert lr_at(config, 10) == pytest.approx(1e-3)
    assert lr_at(config, 60) == pytest.approx(5e-4, rel=1e-5)
    assert lr_at(config, 110) == pytest.approx(0.0, abs=1e-9)
    assert lr_at(config, 500) == pytest.approx(0.0, abs=1e-9)


def test_linear_and_constant():
    linear = OptimConfig(learning_rate=2e-3, warmup_steps=4, total_steps=14, decay="linear")
    assert lr_at(linear, 4) == pytest.approx(2e-3)
    assert lr_at(linear, 9) == pytest.approx(1e-3)
    assert lr_at(linear, 14) == pytest.approx(0.0, abs=1e-9)
    constant = OptimConfig(learning_rate=2e-3, warmup_steps=0, total_steps=5, decay="constant")
    assert lr_at(constant, 0) == pytest.approx(2e-3)
    assert lr_at(constant, 100) == pytest.approx(2e-3)


def test_validation_names_field():
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="decay"):
        OptimConfig(decay="step")
    with pytest.raises(ValueError, match="learning_rate"):
        OptimConfig(learning_rate=0.0)
    with pytest.raises(TypeError):
        OptimConfig(1e-3)  # kw_only


def test_optimizer_builds():
    import jax.numpy as jnp

    optimizer = make_optimizer(OptimConfig(total_steps=10, warmup_steps=2))
    state = optimizer.init({"w": jnp.ones(3)})
    updates, _ = optimizer.update({"w": jnp.full(3, 100.0)}, state, {"w": jnp.ones(3)})
    assert updates["w"].shape == (3,)
