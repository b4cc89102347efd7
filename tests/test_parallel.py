"""pmap data parallelism: replication, batch sharding, the train step, non-finite skipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from components.core.training import parallel
from components.core.training.optim import OptimConfig


class TinyLM(nnx.Module):
    """A real (small) next-token model: embedding, one hidden layer, output projection."""

    def __init__(self, vocab: int = 32, width: int = 16, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.hidden = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(self.embed(tokens))))


def lm_loss_fn(graphdef):
    """Masked next-token cross-entropy over ``tokens``/``loss_mask``, as a stage's loss_fn."""

    def loss_fn(params, batch, rng):
        del rng
        model = nnx.merge(graphdef, params)
        logits = model(batch["tokens"][:, :-1])
        targets = batch["tokens"][:, 1:]
        mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        loss = (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        return loss, {"tokens": mask.sum()}

    return loss_fn


def make_batch(seed: int, batch: int = 16, length: int = 12, vocab: int = 32) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(0, vocab, (batch, length)).astype(np.int32),
        "loss_mask": np.ones((batch, length), bool),
    }


@pytest.fixture(scope="module")
def setup():
    graphdef, params = nnx.split(TinyLM(rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10)
    return graphdef, params, optimizer


def test_pmap_step_matches_single_device(setup):
    graphdef, params, optimizer = setup
    batch = make_batch(0)
    rng = jax.random.PRNGKey(1)
    results = []
    for devices in (jax.local_devices()[:1], jax.local_devices()):
        step = parallel.make_train_step(lm_loss_fn(graphdef), optimizer, devices=devices)
        state = parallel.replicate(parallel.TrainState.create(params, optimizer), devices)
        for _ in range(2):
            state, metrics = step(state, parallel.shard_batch(batch, devices), rng)
        results.append((parallel.unreplicate(state), parallel.unreplicate(metrics)))
    (single, single_metrics), (multi, multi_metrics) = results
    assert int(multi.step) == 2
    np.testing.assert_allclose(single_metrics["loss"], multi_metrics["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(multi.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The step moved the parameters.
    assert not np.allclose(jax.tree.leaves(multi.params)[0], jax.tree.leaves(params)[0])


def test_train_step_lowers_without_running(setup):
    """The memory benchmarks compile the step alone: its arguments and temporaries."""
    graphdef, params, optimizer = setup
    step = parallel.make_train_step(lm_loss_fn(graphdef), optimizer)
    state = parallel.replicate(parallel.TrainState.create(params, optimizer))
    batch = parallel.shard_batch(make_batch(0))
    stats = step.lower(state, batch, jax.random.PRNGKey(1)).compile().memory_analysis()
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    # The state (params, two Adam moments, the step) is an argument of every device's share.
    assert stats.argument_size_in_bytes >= 3 * param_bytes
    assert stats.temp_size_in_bytes > 0


def test_non_finite_loss_is_skipped_and_counted(setup):
    graphdef, params, optimizer = setup
    base = lm_loss_fn(graphdef)

    def loss_fn(p, batch, rng):
        loss, aux = base(p, batch, rng)
        return loss * batch["scale"].mean(), aux

    step = parallel.make_train_step(loss_fn, optimizer)
    state = parallel.replicate(parallel.TrainState.create(params, optimizer))
    before = parallel.unreplicate(state)
    batch = make_batch(1)
    batch["scale"] = np.full((16,), np.nan, np.float32)
    state, metrics = step(state, parallel.shard_batch(batch), jax.random.PRNGKey(0))
    after = parallel.unreplicate(state)
    assert float(parallel.unreplicate(metrics)["skipped"]) == 1.0
    assert int(after.step) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    batch["scale"] = np.ones((16,), np.float32)
    state, metrics = step(state, parallel.shard_batch(batch), jax.random.PRNGKey(0))
    assert float(parallel.unreplicate(metrics)["skipped"]) == 0.0
    assert int(parallel.unreplicate(state).step) == 1


def test_guard_aborts_after_m_in_a_row():
    guard = parallel.NonFiniteGuard(3)
    for step, skipped in enumerate([1.0, 1.0, 0.0, 1.0, 1.0]):
        guard.update(step, skipped)
    assert guard.total == 4
    with pytest.raises(FloatingPointError, match="3 steps in a row"):
        guard.update(5, 1.0)


def test_shard_batch_shapes_and_errors():
    sharded = parallel.shard_batch({"x": np.zeros((16, 3))})
    assert sharded["x"].shape == (8, 2, 3)
    with pytest.raises(ValueError, match=r"batch size 12.*8 local devices.*multiple of 8"):
        parallel.shard_batch({"x": np.zeros((12, 3))})


def test_replicate_unreplicate_round_trip():
    tree = {"a": np.arange(6.0).reshape(2, 3), "b": np.int32(7)}
    replicated = parallel.replicate(tree)
    assert replicated["a"].shape == (8, 2, 3)
    assert len(replicated["a"].sharding.device_set) == parallel.local_device_count() == 8
    back = parallel.unreplicate(replicated)
    np.testing.assert_array_equal(back["a"], tree["a"])
    assert int(back["b"]) == 7
