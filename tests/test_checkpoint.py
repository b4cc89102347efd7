"""Orbax checkpoints: round trip, keep-last-K, model export, where training state lives."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

from components.core.training import checkpoint as ckpt


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32), "step": np.asarray(seed, np.int32)}


def test_round_trip_with_rng_position_and_extras(tmp_path):
    directory = ckpt.work_checkpoint_dir(str(tmp_path / "artifact"))
    assert directory.endswith(os.path.join("artifact", "work", "checkpoints"))
    config = ckpt.CheckpointConfig(save_every=2, keep=5)
    with ckpt.TrainCheckpointer(directory, config) as checkpointer:
        assert checkpointer.restore_latest(_tree(0), np.zeros(2, np.uint32)) is None
        rng = np.asarray(jax.random.PRNGKey(42))
        saved = checkpointer.save(
            4,
            state=_tree(4),
            rng=rng,
            data_position={"epoch": 1, "batches_in_epoch": 3},
            extra_trees={"kl": {"coef": np.float32(0.2)}},
            extra_json={"kl_target": 6.0},
        )
        assert saved
        assert not checkpointer.save(5, state=_tree(5), rng=rng, data_position={})
    with ckpt.TrainCheckpointer(directory, config) as resumed:
        restored = resumed.restore_latest(
            _tree(0), np.zeros(2, np.uint32), {"kl": {"coef": np.float32(0)}}
        )
    assert restored.step == 4
    np.testing.assert_array_equal(restored.state["w"], _tree(4)["w"])
    np.testing.assert_array_equal(restored.rng, rng)
    assert restored.data_position == {"epoch": 1, "batches_in_epoch": 3}
    assert float(restored.extra_trees["kl"]["coef"]) == pytest.approx(0.2)
    assert restored.extra_json == {"kl_target": 6.0}


def test_keeps_last_k_and_forced_final_save(tmp_path):
    config = ckpt.CheckpointConfig(save_every=2, keep=2)
    with ckpt.TrainCheckpointer(str(tmp_path), config) as checkpointer:
        for step in range(1, 10):
            checkpointer.save(
                step,
                state=_tree(step),
                rng=np.zeros(2, np.uint32),
                data_position={},
                force=step == 9,
            )
        checkpointer.wait()
        assert checkpointer.all_steps() == [8, 9]


def test_the_best_step_is_the_highest_metric_and_a_nan_ranks_lowest(tmp_path):
    """PPO's checkpoint selection: a save scored NaN is never the best, nor pushes it out."""
    config = ckpt.CheckpointConfig(save_every=1, keep=1, keep_best=1, async_save=False)
    with ckpt.TrainCheckpointer(str(tmp_path), config) as checkpointer:
        for step, metric in zip(range(1, 6), [0.1, 0.5, float("nan"), 0.3, 0.2], strict=True):
            checkpointer.save(
                step, state=_tree(step), rng=np.zeros(2, np.uint32), data_position={},
                metric=metric,
            )  # fmt: skip
        checkpointer.wait()
        assert checkpointer.best_step() == 2
        assert checkpointer.all_steps() == [2, 5]  # the best and the latest
    with ckpt.TrainCheckpointer(str(tmp_path), config) as again:  # metrics read back
        assert again.best_step() == 2


def test_export_and_load_model_with_nnx_params(tmp_path):
    graphdef, params = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param)
    model_dir = str(tmp_path / "model")
    ckpt.export_model(
        model_dir,
        model_config={"preset": "tiny", "vocab_size": 259},
        params=params,
        extra_config={"step": 12, "tokenizer": {"kind": "byte"}},
    )
    config = ckpt.read_model_config(model_dir)
    assert config["schema_version"] == 1 and config["model"]["preset"] == "tiny"
    assert config["step"] == 12
    abstract = nnx.state(nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(1))), nnx.Param)
    loaded = ckpt.load_model_params(model_dir, abstract)
    model = nnx.merge(graphdef, loaded)
    np.testing.assert_array_equal(model.kernel[...], params["kernel"][...])
    with pytest.raises(ckpt.ModelArtifactError, match="config.json not found"):
        ckpt.read_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="schema_version"):
        ckpt.export_model(
            model_dir, model_config={}, params=params, extra_config={"schema_version": 3}
        )
    # The same export again (a finished stage run again) leaves the artifact as it is, so its
    # fingerprint, kept by the next stage's checkpoints, stays; another config rewrites it.
    same = dict(model_config={"preset": "tiny", "vocab_size": 259}, params=params)
    fingerprint = ckpt.input_fingerprint(model_dir)
    ckpt.export_model(model_dir, **same, extra_config={"step": 12, "tokenizer": {"kind": "byte"}})
    assert ckpt.input_fingerprint(model_dir) == fingerprint
    ckpt.export_model(model_dir, **same, extra_config={"step": 13, "tokenizer": {"kind": "byte"}})
    assert ckpt.input_fingerprint(model_dir) != fingerprint


def test_an_artifact_on_cloud_storage_gets_its_params_written_to_gs_directly(monkeypatch):
    """KFP names a gs:// artifact by its /gcs/ path; Orbax saves params/ to the gs:// URI
    (no rename through the FUSE mount), then config.json marks the export whole."""
    saved, written = [], []

    class Recorder:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def save(self, path, params, force):
            saved.append(path)

        def wait_until_finished(self):
            pass

    monkeypatch.setattr(ckpt.ocp, "StandardCheckpointer", Recorder)
    monkeypatch.setattr(ckpt.fileio, "makedirs", lambda path: None)
    monkeypatch.setattr(ckpt.fileio, "write_text", lambda path, text: written.append(path))
    monkeypatch.setattr(ckpt, "_already_exported", lambda model_dir, text: False)
    ckpt.export_model("/gcs/bucket/run/ppo/model", model_config={}, params={}, extra_config={})
    assert saved == ["gs://bucket/run/ppo/model/params"]
    assert written == ["/gcs/bucket/run/ppo/model/config.json"]
    assert ckpt.gcs_uri("/tmp/model") == "/tmp/model"


def _pure(model) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_load_model_gives_the_stored_parameters_and_draws_only_a_new_head(tmp_path):
    from components.core.model.artifact import create_model, load_model, save_model

    def saved(name: str, head: bool, seed: int) -> tuple[str, dict]:
        model = create_model("tiny", 300, scalar_head=head, seed=seed)
        folder = str(tmp_path / name)
        save_model(folder, model, nnx.state(model, nnx.Param), tokenizer={}, stage="sft",
                   training={}, step=0)  # fmt: skip
        return folder, _pure(model)

    policy, policy_params = saved("policy", head=False, seed=3)
    reward, reward_params = saved("reward", head=True, seed=4)
    # Every parameter from the artifact (the seed draws nothing): a load is the saved model,
    # whole, in host memory; a stored head is kept, or dropped for a policy.
    for folder, head, want in [(policy, None, policy_params), (reward, None, reward_params)]:
        model, _ = load_model(folder, scalar_head=head, seed=9)
        jax.tree.map(np.testing.assert_array_equal, _pure(model), want)
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        assert all(isinstance(leaf, jax.Array) for leaf in leaves)
        assert {d.platform for leaf in leaves for d in leaf.devices()} == {"cpu"}
    dropped, _ = load_model(reward, scalar_head=False)
    assert dropped.scalar_head is None
    want = {k: v for k, v in reward_params.items() if k != "scalar_head"}
    jax.tree.map(np.testing.assert_array_equal, _pure(dropped), want)
    # A head on a policy: the one a fresh model of that seed has, on the stored backbone.
    critic, _ = load_model(policy, scalar_head=True, seed=5)
    got = _pure(critic)
    fresh = _pure(create_model("tiny", 300, scalar_head=True, seed=5))
    jax.tree.map(np.testing.assert_array_equal, got.pop("scalar_head"), fresh["scalar_head"])
    jax.tree.map(np.testing.assert_array_equal, got, policy_params)


# ---- where training state lives ----------------------------------------------------------
# Kill and resume of a real process: tests/test_durable_checkpoints.py (the trainer's loop,
# state keyed by stage and inputs, a new output folder) and tests/test_reward_processes.py (a
# whole stage, state in its artifact).


def test_training_state_dir_is_the_durable_folder_when_set(tmp_path, monkeypatch):
    artifact = str(tmp_path / "model")
    monkeypatch.delenv(ckpt.CHECKPOINT_DIR_ENV, raising=False)
    assert ckpt.training_state_dir(artifact) == ckpt.work_checkpoint_dir(artifact)
    keyed = ckpt.keyed_state_dir("gs://bucket/ckpt/", "reward", "0c1d9f")
    assert keyed == "gs://bucket/ckpt/reward/0c1d9f"
    monkeypatch.setenv(ckpt.CHECKPOINT_DIR_ENV, keyed)
    assert ckpt.training_state_dir(artifact) == keyed
    assert ckpt.keyed_state_dir("runs/ckpt", "sft", "7") == os.path.abspath("runs/ckpt/sft/7")


@pytest.mark.parametrize(
    ("root", "stage", "key", "message"),
    [
        ("", "sft", "0c1d9f", "checkpoint_root: '' has no keyed folders"),
        ("gs://b/c", "../other", "0c1d9f", "stage '../other' is not a folder name"),
        ("gs://b/c", "ppo", "a/b", "key 'a/b' is not a folder name"),
        ("/gcs/b/c", "sft", "0c1d9f", "Cloud Storage FUSE mount"),
    ],
)
def test_keyed_state_dir_refuses_what_is_no_folder(root, stage, key, message):
    with pytest.raises(ValueError, match=message):
        ckpt.keyed_state_dir(root, stage, key)


def test_a_checkpoint_of_another_model_or_with_damaged_files_is_refused_by_name(tmp_path):
    """Orbax's own errors (a shape that differs, a file gone) become one that names the step
    and the ways on; a checkpoint saved without an identity restores as before."""
    config = ckpt.CheckpointConfig()
    with ckpt.TrainCheckpointer(str(tmp_path), config, {"stage": "sft"}) as checkpointer:
        checkpointer.save(2, state=_tree(2), rng=np.zeros(2, np.uint32), data_position={})
    with ckpt.TrainCheckpointer(str(tmp_path), config) as plain:
        assert plain.restore_latest(_tree(0), np.zeros(2, np.uint32)).step == 2
    wider = {**_tree(0), "bias": np.zeros(5, np.float32)}  # another model: a tree that differs
    with ckpt.TrainCheckpointer(str(tmp_path), config, {"stage": "sft"}) as other:
        refused = "checkpoint of step 2 in .* cannot be restored into this run .*step folder 2"
        with pytest.raises(ckpt.CheckpointRestoreError, match=refused):
            other.restore_latest(wider, np.zeros(2, np.uint32))
    for folder, _, names in os.walk(tmp_path / "2" / "state"):
        for name in names:
            if os.path.basename(folder) == "d":
                os.remove(os.path.join(folder, name))
    with ckpt.TrainCheckpointer(str(tmp_path), config, {"stage": "sft"}) as damaged:
        with pytest.raises(ckpt.CheckpointRestoreError, match="cannot be restored into this run"):
            damaged.restore_latest(_tree(0), np.zeros(2, np.uint32))


def test_a_refusal_in_the_durable_state_folder_says_to_remove_it(tmp_path, monkeypatch):
    """Under $ALIGNPIPE_CHECKPOINT_DIR no --output starts over: the refusal names the folder."""
    config = ckpt.CheckpointConfig()
    with ckpt.TrainCheckpointer(str(tmp_path), config, {"--shards": "a"}) as checkpointer:
        checkpointer.save(2, state=_tree(2), rng=np.zeros(2, np.uint32), data_position={})
    other = ckpt.TrainCheckpointer(str(tmp_path), config, {"--shards": "b"})
    refused = r"written with another --shards than now \(then files with fingerprint a; now"
    with pytest.raises(ckpt.CheckpointRestoreError, match=refused + ".* or a new --output to"):
        other.restore_latest(_tree(0), np.zeros(2, np.uint32))
    monkeypatch.setenv(ckpt.CHECKPOINT_DIR_ENV, str(tmp_path))
    with pytest.raises(ckpt.CheckpointRestoreError, match=f"or remove {tmp_path} \\(\\$ALIGNPIPE"):
        other.restore_latest(_tree(0), np.zeros(2, np.uint32))
    other.close()
