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


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adamw_step_is_the_optax_chain_bit_for_bit(weight_decay):
    """adamw_step = make_optimizer's update, then apply_updates, the update scaled by
    lr_scale; a step not applied leaves parameters and state exactly as they were."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from components.core.training.optim import adamw_step

    config = OptimConfig(
        learning_rate=1e-2, warmup_steps=2, total_steps=8, max_grad_norm=1.0,
        weight_decay=weight_decay,
    )  # fmt: skip
    optimizer = make_optimizer(config)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), "b": jnp.ones(3)}

    @jax.jit
    def chain(params, opt_state, grads, lr_scale):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: u * lr_scale, updates)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def fused(params, opt_state, grads, apply, lr_scale):
        return adamw_step(config, params, grads, opt_state, apply, lr_scale=lr_scale)

    reference = (params, optimizer.init(params))
    state = reference
    clipped = 0
    for step in range(6):
        # Norms from 0.3 to 4.8: some steps under max_grad_norm, some clipped.
        scale = 0.3 * 2.0 ** (step % 5)
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        grads = optax.tree.scale(scale / optax.tree.norm(grads), grads)
        clipped += scale > config.max_grad_norm
        lr_scale = jnp.float32(0.5 if step == 3 else 1.0)
        reference = chain(*reference, grads, lr_scale)
        state = fused(*state, grads, jnp.bool_(True), lr_scale)
        for want, got in zip(jax.tree.leaves(reference), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # A non-finite step: nothing moves, the step counts do not advance.
        bad = jax.tree.map(lambda g: g * jnp.nan, grads)
        kept = fused(*state, bad, jnp.bool_(False), lr_scale)
        for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(kept), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert 0 < clipped < 6
    assert int(state[1][1][0].count) == 6
