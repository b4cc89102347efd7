"""Sharded state inside pmap (fsdp.py): placement, gathering, and steps equal to replicated ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from components.core.model.sampler import generate
from components.core.model.transformer import Transformer, model_config
from components.core.training import fsdp, parallel
from components.core.training.optim import OptimConfig, clip_by_global_norm, make_optimizer

DEVICES = 8


def test_shard_splits_tensors_and_round_trips():
    tree = {
        "blocks": {"w": np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)},
        "embed": np.arange(13, dtype=np.float32),  # 13 does not divide by 8: padded
        "step": np.int32(4),
    }
    placed = fsdp.shard(tree)
    blocks, embed = placed["blocks"]["w"], placed["embed"]
    assert isinstance(blocks, fsdp.Sharded) and isinstance(embed, fsdp.Sharded)
    # The layer axis stays whole; each device holds ceil(15 / 8) = 2 of each layer's 15.
    assert blocks.chunk.shape == (DEVICES, 2, 2) and blocks.rest == (3, 5)
    assert embed.chunk.shape == (DEVICES, 2) and embed.rest == (13,)
    assert placed["step"].shape == (DEVICES,)  # scalars are replicated
    # Device i holds elements 2i, 2i + 1 of the flattened tensor; the tail is zero padding.
    np.testing.assert_array_equal(np.asarray(embed.chunk)[6], [12.0, 0.0])
    np.testing.assert_array_equal(np.asarray(blocks.chunk)[1, 1], [17.0, 18.0])
    back = parallel.unreplicate(placed)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gather_and_norm_inside_pmap_equal_the_full_tensors():
    tree = {
        "blocks": {"w": np.random.default_rng(0).normal(size=(3, 4, 7)).astype(np.float32)},
        "head": np.random.default_rng(1).normal(size=(9, 2)).astype(np.float32),
    }

    def inside(placed):
        outer = fsdp.gather_outer(placed)
        # The stack stays sharded until a scan step gathers one layer of it.
        assert isinstance(outer["blocks"]["w"], fsdp.Sharded)
        layers = jax.lax.map(fsdp.gather, outer["blocks"]["w"])
        return outer["head"], layers, fsdp.global_norm(placed)

    head, layers, norm = jax.pmap(inside, axis_name="data")(fsdp.shard(tree))
    np.testing.assert_array_equal(np.asarray(head)[5], tree["head"])
    np.testing.assert_array_equal(np.asarray(layers)[3], tree["blocks"]["w"])
    np.testing.assert_allclose(np.asarray(norm), float(optax.tree.norm(tree)), rtol=1e-6)


def test_mean_over_devices_is_one_all_reduce_and_none_on_one_device():
    rows = np.random.default_rng(2).normal(size=(DEVICES, 3, 5)).astype(np.float32)
    tree = {"a": rows, "b": rows[:, 0, :2] * 3.0}

    def mean(local):
        return fsdp.mean_over_devices(local, "data")

    spread = jax.pmap(mean, axis_name="data")
    got = spread(tree)
    np.testing.assert_allclose(np.asarray(got["a"])[4], rows.mean(0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got["b"])[7], rows[:, 0, :2].mean(0) * 3.0, rtol=1e-6)
    assert spread.lower(tree).as_text().count("all_reduce") == 1  # both leaves in one
    one = {k: v[:1] for k, v in tree.items()}
    alone = jax.pmap(mean, axis_name="data", devices=jax.devices()[:1])
    for key, value in alone(one).items():
        np.testing.assert_array_equal(np.asarray(value), one[key])  # its own mean, bit for bit
    assert "all_reduce" not in alone.lower(one).as_text()


def test_clip_covers_every_devices_chunk():
    grads = {
        "blocks": {"w": np.random.default_rng(2).normal(size=(2, 5, 3)).astype(np.float32)},
        "b": np.random.default_rng(3).normal(size=(11,)).astype(np.float32),
    }
    norm = float(optax.tree.norm(grads))
    expected, _ = optax.clip_by_global_norm(norm / 3).update(grads, optax.EmptyState())

    def clipped(placed):
        return clip_by_global_norm(norm / 3).update(placed, optax.EmptyState())[0]

    got = parallel.unreplicate(jax.pmap(clipped, axis_name="data")(fsdp.shard(grads)))
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert float(optax.tree.norm(got)) == pytest.approx(norm / 3, rel=1e-6)


def _lm_loss(graphdef):
    def loss_fn(params, batch, rng):
        del rng
        model = nnx.merge(graphdef, params)
        logprobs = model.token_logprobs(batch["tokens"], batch["mask"])
        return -jnp.mean(logprobs), {"first_logprob": jnp.mean(logprobs[:, 0])}

    return loss_fn


@pytest.fixture(scope="module")
def trained():
    """Two AdamW steps (gradients clipped) of a tiny Transformer: 1 device, 8, 8 sharded."""
    config = model_config("tiny", 48)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    # max_grad_norm below the gradients' norm: the clip (a cross-device norm when sharded) acts.
    optimizer = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10, max_grad_norm=0.05)
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, 48, (16, 12)).astype(np.int32),
        "mask": np.ones((16, 12), np.int32),
    }
    results = {}
    for name, devices, sharded in (
        ("single", jax.local_devices()[:1], False),
        ("replicated", jax.local_devices(), False),
        ("sharded", jax.local_devices(), True),
    ):
        step = parallel.make_train_step(_lm_loss(graphdef), optimizer, devices=devices)
        state = parallel.TrainState.create(params, optimizer)
        state = parallel.place(state, sharded=sharded, devices=devices)
        history = []
        for _ in range(2):
            state, metrics = step(state, parallel.shard_batch(batch, devices), jax.random.key(1))
            history.append(parallel.unreplicate(metrics))
        results[name] = (state, parallel.unreplicate(state), history)
    return params, results


def test_sharded_step_equals_replicated_and_single_device(trained):
    params, results = trained
    _, single, single_metrics = results["single"]
    placed, sharded, sharded_metrics = results["sharded"]
    assert fsdp.is_sharded(placed.params) and fsdp.is_sharded(placed.opt_state)
    assert int(sharded.step) == 2
    assert single_metrics[0]["grad_norm"] > 0.05  # the clip was active
    for a, b in zip(single_metrics, sharded_metrics, strict=True):
        for name in ("loss", "grad_norm", "first_logprob"):
            np.testing.assert_allclose(a[name], b[name], rtol=2e-5)
    # Adam moments hold the clipped gradients; parameters moved by ~lr = 1e-2 per step
    # (Adam divides tiny gradients by their tiny norms: a few 1e-6 of summation order).
    for tree, atol in (("opt_state", 1e-7), ("params", 1e-5)):
        ours = jax.tree.leaves(getattr(sharded, tree))
        theirs = jax.tree.leaves(getattr(single, tree))
        for a, b in zip(theirs, ours, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=atol)
    _, replicated, _ = results["replicated"]
    pairs = zip(jax.tree.leaves(replicated.params), jax.tree.leaves(sharded.params), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5)
    start, end = jax.tree.leaves(params), jax.tree.leaves(sharded.params)
    assert all(not np.allclose(a, b) for a, b in zip(start, end, strict=True))


def test_sharded_state_holds_one_eighth_per_device(trained):
    params, results = trained
    placed = results["sharded"][0]
    full = sum(np.asarray(x).size for x in jax.tree.leaves(params))
    per_device = sum(
        x.chunk.shape[1:] and np.prod(x.chunk.shape[1:])
        for x in jax.tree.leaves(placed.params, is_leaf=lambda n: isinstance(n, fsdp.Sharded))
    )
    # Padding to a multiple of 8 per tensor (per layer for the stack) is all it adds.
    assert full / DEVICES <= per_device <= full / DEVICES + 8 * 64


def _pmapped_sampler(graphdef: nnx.GraphDef, prompts: np.ndarray):
    """(pmapped 6-token sampler of ``graphdef``'s model, ``prompts`` [16, 5] sharded)."""
    batch = parallel.shard_batch({"tokens": prompts, "mask": np.ones_like(prompts)})

    def sample(placed, batch):
        return generate(
            (graphdef, placed), batch["tokens"], batch["mask"], jax.random.key(0),
            max_new_tokens=6, eos_id=1, pad_id=0,
        )  # fmt: skip

    return jax.pmap(sample, axis_name="data"), batch


def test_sampling_from_sharded_params_equals_replicated():
    """The KV-cache sampler gathers one layer per decode step: same tokens, same log-probs."""
    graphdef, params = nnx.split(Transformer(model_config("tiny", 48), rngs=nnx.Rngs(3)), nnx.Param)
    prompts = np.random.default_rng(4).integers(3, 48, (16, 5)).astype(np.int32)
    run, batch = _pmapped_sampler(graphdef, prompts)
    replicated = run(parallel.place(params), batch)
    sharded = run(parallel.place(params, sharded=True), batch)
    np.testing.assert_array_equal(sharded.tokens, replicated.tokens)
    np.testing.assert_allclose(sharded.logprobs, replicated.logprobs, rtol=1e-5, atol=1e-6)


def test_sharded_decode_gathers_one_layer_at_a_time():
    """The decode runs its layers unrolled; each is gathered after the last one ran.

    XLA's compiled temp memory: without the ordering (fsdp.after) it held all six layers.
    """
    config = model_config("tiny", 48, n_layers=6, hidden_dim=8192)  # a layer: 3 MiB
    model = Transformer(config, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model, nnx.Param)
    layer = sum(leaf[0].nbytes for leaf in jax.tree.leaves(nnx.split(model.blocks)[1]))
    run, batch = _pmapped_sampler(graphdef, np.ones((16, 5), np.int32))
    compiled = run.lower(parallel.place(params, sharded=True), batch).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * layer


def test_models_and_optimizer_state_are_built_in_host_memory(tmp_path, monkeypatch):
    """Nothing whole lands on the default device (accelerator 0 on a TPU) before placement.

    On CPU the host is device 0 too, so the host here is played by CPU device 3.
    """
    from components.core.model.artifact import create_model, load_model, save_model
    from components.core.training import host

    stand_in = jax.devices("cpu")[3]
    monkeypatch.setattr(host, "host_device", lambda: stand_in)
    model = create_model("tiny", 48, scalar_head=True, seed=0)
    params = nnx.state(model, nnx.Param)
    state = parallel.TrainState.create(params, make_optimizer(OptimConfig()))
    save_model(str(tmp_path / "m"), model, params, tokenizer={}, stage="t", training={}, step=0)
    loaded, _ = load_model(str(tmp_path / "m"), scalar_head=True)
    trees = {"created": params, "opt_state": state.opt_state, "loaded": nnx.state(loaded)}
    for name, tree in trees.items():
        devices = {d for leaf in jax.tree.leaves(tree) for d in leaf.devices()}
        assert devices == {stand_in}, name


def test_sharded_rollout_holds_one_network_embedding_at_a_time():
    """PPO's rollout scores with four networks; each gathers its embedding in turn.

    XLA's compiled temp memory: without the ordering (fsdp.after) it held 4.4 embeddings.
    """
    from components.ppo import PPOConfig
    from components.ppo.kl_control import init_kl_controller
    from components.ppo.rollout import Models, RolloutParams, ScoreNorm, TokenIds, make_rollout

    vocab, batch = 65536, 16  # the tiny model's 32-wide embedding: 8 MiB, all else small
    config = PPOConfig(rollout_batch_size=batch, prompt_len=6, max_new_tokens=5)
    policy = Transformer(model_config("tiny", vocab, max_seq_len=32), rngs=nnx.Rngs(1))
    critic = Transformer(
        model_config("tiny", vocab, max_seq_len=32), rngs=nnx.Rngs(2), scalar_head=True
    )
    (policy_graph, policy_params), (critic_graph, critic_params) = (
        nnx.split(policy, nnx.Param),
        nnx.split(critic, nnx.Param),
    )
    rollout = make_rollout(
        Models(policy_graph, critic_graph, critic_graph), config, TokenIds(1, 0),
        ScoreNorm(0.0, 1.0, 0.0, 0.0),
    )  # fmt: skip
    prompts = parallel.shard_batch(
        {
            "prompt_tokens": np.full((batch, 6), 5, np.int32),
            "prompt_mask": np.ones((batch, 6), np.int32),
        }
    )
    trees = (policy_params, policy_params, critic_params, critic_params)
    params = RolloutParams(*(parallel.place(t, sharded=True) for t in trees))
    controller = init_kl_controller("fixed", 0.1)
    compiled = rollout.lower(params, prompts, jax.random.key(0), controller).compile()
    embedding = vocab * 32 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * embedding


def test_checkpoint_keeps_chunks_on_save_and_restores_whole_tensors(tmp_path):
    """No host gathers sharded state to save it; a restore gives whole tensors for any layout."""
    from components.core.training.checkpoint import CheckpointConfig, TrainCheckpointer

    # A stack of 8 layers of 8 x 3: its chunks [8 devices, 8 layers, 3] look like the tensor.
    params = {
        "blocks": {"w": np.arange(8 * 8 * 3, dtype=np.float32).reshape(8, 8, 3)},
        "head": np.arange(13, dtype=np.float32),
    }
    state = parallel.TrainState.create(params, make_optimizer(OptimConfig()))
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 1, state.opt_state))
    view = parallel.checkpoint_view(parallel.place(state, sharded=True))
    assert view.params["blocks"]["w"].shape == (DEVICES, 8, 3)  # chunks, not gathered
    assert isinstance(view.params["blocks"]["w"], jax.Array)
    rng = np.asarray(jax.random.PRNGKey(0))
    with TrainCheckpointer(str(tmp_path), CheckpointConfig(async_save=True)) as checkpointer:
        checkpointer.save(3, state=view, rng=rng, data_position={}, force=True, chunks=DEVICES)
    template = parallel.TrainState.create(params, make_optimizer(OptimConfig()))
    with TrainCheckpointer(str(tmp_path), CheckpointConfig()) as checkpointer:
        restored = checkpointer.restore_latest(template, rng)
    expected = jax.device_get(state)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(restored.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_table_read_by_rows_is_never_gathered_and_its_gradient_stays_in_chunks():
    """Gemma 4's per-layer input table under fsdp (fsdp.sharded_rows): each device's rows
    equal the whole table's, the chunks' gradient is the whole gradient's (summed over the
    devices, as every fsdp gradient), and gather_outer leaves the table in its chunks."""
    vocab, width = 37, 10  # 370 elements over 8 devices: chunks of 47, not whole rows
    table = np.random.default_rng(0).normal(size=(vocab, width)).astype(np.float32)
    ids = np.random.default_rng(1).integers(0, vocab, size=(DEVICES, 3, 5))
    weights = np.random.default_rng(2).normal(size=(DEVICES, 3, 5, width)).astype(np.float32)
    placed = fsdp.shard({"per_layer_inputs": {"table": table}}, jax.local_devices()[:DEVICES])

    def loss(params, ids, weights):
        node = fsdp.gather_outer(params)["per_layer_inputs"]["table"]
        assert isinstance(node, fsdp.Sharded)
        return jnp.sum(fsdp.sharded_rows(node, ids) * weights)

    rows = jax.pmap(
        lambda p, i: fsdp.sharded_rows(fsdp.gather_outer(p)["per_layer_inputs"]["table"], i),
        axis_name=fsdp.AXIS,
    )(placed, ids)
    np.testing.assert_array_equal(np.asarray(rows), table[ids])
    grads = jax.pmap(jax.grad(loss), axis_name=fsdp.AXIS)(placed, ids, weights)
    chunks = grads["per_layer_inputs"]["table"]
    whole = fsdp.unshard(jax.tree.map(np.asarray, chunks))
    expected = np.zeros_like(table)
    np.add.at(expected, ids.reshape(-1), weights.reshape(-1, width))
    np.testing.assert_allclose(whole, expected, rtol=1e-5, atol=1e-5)
