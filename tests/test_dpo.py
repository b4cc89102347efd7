"""DPO stage: the loss against NumPy, and end to end on the built-in task (tiny models, 8 CPUs).

One module fixture shards the task and trains the sft policy; one DPO run (``RUN``) serves
the gold-reward, artifact and resume tests, so the train step compiles once for them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.data.builtin_task import write_jsonl
from components.core.data.gold import policy_gold_scores
from components.core.data.input_pipeline import longest_lengths, read_manifest
from components.core.model.artifact import ModelMismatchError, load_model
from components.core.training import parallel
from components.core.training.checkpoint import read_model_config, work_checkpoint_dir
from components.core.training.metrics import read_metrics
from components.dpo import DPOConfig, run
from components.dpo.__main__ import main as dpo_main
from components.dpo.config import FROM_SCRATCH_LEARNING_RATE, PRETRAINED_LEARNING_RATE
from components.dpo.train import PairLogps, dpo_terms, response_weights, sequence_logps
from components.sft import SFTConfig
from components.sft import run as run_sft
from components.shard import ShardConfig
from components.shard import run as run_shard

TRL_NAMES = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
TRAIN = dict(preset="tiny", batch_size=64, warmup_steps=10, eval_every=1000)
# The DPO run the end-to-end tests share: a checkpoint halfway for the resume tests.
RUN = dict(TRAIN, steps=60, learning_rate=1e-3, save_every=30, eval_every=30)


# --- the loss against NumPy ------------------------------------------------------------------


def _pair_batch(prompt_lens, chosen_lens, rejected_lens, length: int) -> dict[str, np.ndarray]:
    """Masks of right-padded prompt + response rows, as input_pipeline builds them."""
    positions = np.arange(length)[None]
    prompt, chosen, rejected = (
        np.asarray(x)[:, None] for x in (prompt_lens, chosen_lens, rejected_lens)
    )
    return {
        "chosen_mask": positions < prompt + chosen,
        "loss_mask": (positions >= prompt) & (positions < prompt + chosen),
        "rejected_mask": positions < prompt + rejected,
    }


def _numpy_logps(token_logps, prompt_lens, response_lens, *, average: bool) -> np.ndarray:
    """Sum (or mean) of the log-probs at positions P − 1 … P + R − 2 (they predict the response)."""
    out = []
    for row, p, r in zip(token_logps, prompt_lens, response_lens, strict=True):
        picked = row[p - 1 : p + r - 1]
        out.append(picked.mean() if average else picked.sum())
    return np.asarray(out)


def _numpy_loss(h: np.ndarray, beta: float, loss_type: str, smoothing: float) -> np.ndarray:
    def nll(x):  # −log σ(x)
        return np.log1p(np.exp(-x))

    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    return (1 - smoothing) * nll(beta * h) + smoothing * nll(-beta * h)


@pytest.mark.parametrize(
    "loss_type,beta,smoothing", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0)]
)
def test_loss_matches_numpy_reference(loss_type, beta, smoothing):
    rng = np.random.default_rng(0)
    length, pairs = 12, 5
    prompt_lens = np.array([1, 3, 4, 2, 6])
    chosen_lens = np.array([4, 2, 8, 1, 6])
    rejected_lens = np.array([2, 5, 3, 7, 1])
    batch = _pair_batch(prompt_lens, chosen_lens, rejected_lens, length)
    chosen_w, rejected_w = response_weights(batch)
    average = loss_type == "ipo"
    logps = {}  # (network, response) -> (ours, numpy)
    for network in ("policy", "reference"):
        for name, weights, lens in (
            ("chosen", chosen_w, chosen_lens),
            ("rejected", rejected_w, rejected_lens),
        ):
            # Garbage on the padding and prompt positions: the masks must drop it.
            token_logps = rng.normal(-2.0, 1.5, (pairs, length - 1)).astype(np.float32)
            ours = sequence_logps(jnp.asarray(token_logps), weights, average=average)
            expected = _numpy_logps(token_logps, prompt_lens, lens, average=average)
            np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-5)
            logps[network, name] = np.asarray(ours)
    policy = PairLogps(logps["policy", "chosen"], logps["policy", "rejected"])
    reference = PairLogps(logps["reference", "chosen"], logps["reference", "rejected"])
    terms = dpo_terms(policy, reference, beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    chosen_ratio = policy.chosen.astype(np.float64) - reference.chosen
    rejected_ratio = policy.rejected.astype(np.float64) - reference.rejected
    expected = _numpy_loss(chosen_ratio - rejected_ratio, beta, loss_type, smoothing)
    np.testing.assert_allclose(terms.losses, expected, rtol=1e-5)
    np.testing.assert_allclose(terms.chosen_rewards, beta * chosen_ratio, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(terms.rejected_rewards, beta * rejected_ratio, rtol=1e-5, atol=1e-6)


def test_loss_at_the_reference_is_log_2_and_has_the_dpo_gradient():
    """At π = π_ref the sigmoid loss is log 2; its slope in h is −β/2, as the paper's gradient."""
    zeros = PairLogps(jnp.zeros(3), jnp.zeros(3))
    terms = dpo_terms(zeros, zeros, beta=0.1, loss_type="sigmoid")
    np.testing.assert_allclose(terms.losses, np.log(2.0), rtol=1e-6)

    def loss(h):
        return dpo_terms(PairLogps(h, 0.0), PairLogps(0.0, 0.0), beta=0.1, loss_type="sigmoid")[0]

    assert float(jax.grad(loss)(0.0)) == pytest.approx(-0.05)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="beta: 0.0 must be > 0"):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match="beta: -0.1 must be > 0"):
        DPOConfig(beta=-0.1)
    with pytest.raises(ValueError, match=r"label_smoothing: 0.5 must be in \[0, 0.5\)"):
        DPOConfig(label_smoothing=0.5)
    with pytest.raises(ValueError, match="applies to loss_type sigmoid only"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_type: 'hinge' must be one of"):
        DPOConfig(loss_type="hinge")
    config = DPOConfig()
    assert (config.beta, config.loss_type, config.label_smoothing) == (0.1, "sigmoid", 0.0)
    assert config.resolved(pretrained=True).learning_rate == PRETRAINED_LEARNING_RATE == 5e-7
    assert config.resolved(pretrained=False).learning_rate == FROM_SCRATCH_LEARNING_RATE
    assert DPOConfig(learning_rate=3e-6).resolved(pretrained=True).learning_rate == 3e-6


# --- end to end on the built-in task ---------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dpo_inputs")
    write_jsonl(str(root / "pairs.jsonl"), 2000)
    paths = {name: str(root / name) for name in ("shards", "sft")}
    config = ShardConfig(num_shards=8, tokenizer="builtin-words")
    run_shard(config, [str(root / "pairs.jsonl")], paths["shards"])
    sft = SFTConfig(**{**TRAIN, "warmup_steps": 20}, steps=300, learning_rate=1e-2, save_every=1000)
    run_sft(sft, paths["shards"], paths["sft"])
    return paths


@pytest.fixture(scope="module")
def aligned(artifacts, tmp_path_factory) -> tuple[dict[str, float], str]:
    output = str(tmp_path_factory.mktemp("dpo_run") / "policy")
    return run(DPOConfig(**RUN), artifacts["shards"], artifacts["sft"], output), output


def _gold_per_prompt(model_dir: str, shards_dir: str, samples: int = 4) -> np.ndarray:
    """Mean gold reward of ``samples`` samples per unique eval prompt (keys shared by policies)."""
    model, _ = load_model(model_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    manifest = read_manifest(shards_dir)
    prompt_len, response_len = longest_lengths(manifest)
    scores = policy_gold_scores(
        graphdef, parallel.replicate(params), shards_dir, manifest["gold_reward"],
        prompt_len=prompt_len, max_new_tokens=response_len, temperature=1.0,
        samples_per_prompt=samples, seed=0,
    )  # fmt: skip
    return scores.mean(axis=1)


@pytest.mark.slow
def test_dpo_raises_gold_reward_over_the_sft_policy(artifacts, aligned):
    _, output = aligned
    before = _gold_per_prompt(artifacts["sft"], artifacts["shards"])
    after = _gold_per_prompt(output, artifacts["shards"])
    gain = after - before  # per prompt, with the same sampling keys
    stderr = gain.std(ddof=1) / np.sqrt(len(gain))
    print(f"gold on {len(gain)} eval prompts: {before.mean():.3f} -> {after.mean():.3f} "
          f"(+{gain.mean():.3f} ± {stderr:.3f})")  # fmt: skip
    assert gain.mean() > 0.15 and gain.mean() > 4 * stderr


@pytest.mark.slow
def test_output_is_a_dpo_policy_artifact_with_trl_metrics(artifacts, aligned):
    metrics, output = aligned
    model, info = load_model(output)
    assert info["stage"] == "dpo" and info["step"] == RUN["steps"]
    assert model.scalar_head is None and info["pretrained"] is False
    assert info["training"]["beta"] == 0.1 and info["training"]["learning_rate"] == 1e-3
    records = read_metrics(output)
    assert [r["step"] for r in records] == list(range(1, RUN["steps"] + 1))
    for name in TRL_NAMES:
        assert all(np.isfinite(r[name]) for r in records), name
        assert np.isfinite(metrics[f"eval/{name}"]), name
    # The first step starts at the reference: rewards 0, loss log 2.
    assert records[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-4)
    assert abs(records[0]["rewards/margins"]) < 1e-4
    # Trained: held-out pairs ranked by the implicit reward, the margin grown.
    assert metrics["eval/rewards/accuracies"] > 0.7
    assert metrics["eval/rewards/margins"] > 0.3
    assert metrics["eval/loss"] < np.log(2.0) - 0.1


def _checkpoint_steps(output: str) -> list[int]:
    folder = work_checkpoint_dir(output)
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def _params(model_dir: str) -> dict:
    model, _ = load_model(model_dir)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _halfway_copy(uninterrupted: str, output: str) -> None:
    """``output`` as a run killed after its halfway checkpoint: the work folder up to it."""
    shutil.copytree(os.path.join(uninterrupted, "work"), os.path.join(output, "work"))
    for step in _checkpoint_steps(output):
        if step > RUN["save_every"]:
            shutil.rmtree(os.path.join(work_checkpoint_dir(output), str(step)))
    assert _checkpoint_steps(output) == [RUN["save_every"]]


@pytest.mark.slow
def test_resume_from_halfway_ends_with_identical_parameters(artifacts, aligned, tmp_path):
    _, uninterrupted = aligned
    output = str(tmp_path / "policy")
    _halfway_copy(uninterrupted, output)
    run(DPOConfig(**RUN), artifacts["shards"], artifacts["sft"], output)
    assert [r["step"] for r in read_metrics(output)] == list(range(31, RUN["steps"] + 1))
    jax.tree.map(np.testing.assert_array_equal, _params(output), _params(uninterrupted))


@pytest.mark.slow
def test_cli_with_fsdp_resumes_a_replicated_checkpoint_alike(
    artifacts, aligned, tmp_path, sharded_placements
):
    """fsdp: state and reference in chunks; checkpoints hold whole tensors, so the replicated
    run's halfway checkpoint resumes sharded and reaches the same parameters."""
    metrics, uninterrupted = aligned
    output = str(tmp_path / "policy")
    _halfway_copy(uninterrupted, output)
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in RUN.items()]
    paths = ["--shards", artifacts["shards"], "--policy", artifacts["sft"], "--output", output]
    assert dpo_main([*paths, *flags, "--fsdp"]) == 0
    # Reference, train state, the final eval's parameters.
    assert len(sharded_placements) >= 3 and all(sharded_placements)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        _params(output),
        _params(uninterrupted),
    )
    final = read_metrics(output)[-1]
    assert final["eval/loss"] == pytest.approx(metrics["eval/loss"], rel=1e-4)


def _pretrained_copy(model_dir: str, folder) -> str:
    """``model_dir`` with its config.json marked as descending from pretrained weights."""
    info = read_model_config(model_dir)
    folder.mkdir()
    os.symlink(os.path.join(model_dir, "params"), folder / "params")
    (folder / "config.json").write_text(json.dumps({**info, "pretrained": True}))
    return str(folder)


@pytest.mark.slow
def test_ipo_from_a_pretrained_policy_starts_at_its_target(artifacts, tmp_path):
    """IPO at the reference: h = 0, loss (1/(2β))²; a pretrained start gets 5e-7 and passes
    ``pretrained`` on."""
    policy = _pretrained_copy(artifacts["sft"], tmp_path / "pretrained")
    output = str(tmp_path / "ipo")
    config = DPOConfig(**TRAIN, steps=2, eval_batches=1, loss_type="ipo", beta=0.25)
    summary = run(config, artifacts["shards"], policy, output)
    first = read_metrics(output)[0]
    assert first["loss"] == pytest.approx((1 / (2 * 0.25)) ** 2, rel=1e-4)
    # Per-token means (IPO, as TRL): the sft policy sums about -17 nats per response.
    assert -5.0 < first["logps/chosen"] < 0.0
    assert np.isfinite(summary["eval/loss"])
    info = read_model_config(output)
    assert info["training"]["learning_rate"] == PRETRAINED_LEARNING_RATE
    assert info["training"]["loss_type"] == "ipo" and info["pretrained"] is True
    assert max(r["learning_rate"] for r in read_metrics(output)) <= PRETRAINED_LEARNING_RATE


@pytest.mark.slow
def test_bad_inputs_get_clear_errors(artifacts, tmp_path):
    # A reward model (a policy artifact with a scalar head) is not a policy.
    reward = tmp_path / "reward"
    reward.mkdir()
    os.symlink(os.path.join(artifacts["sft"], "params"), reward / "params")
    info = read_model_config(artifacts["sft"])
    config_json = {**info, "stage": "reward", "scalar_head": True}
    (reward / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ModelMismatchError, match="is a reward model .* not a policy"):
        run(DPOConfig(**TRAIN, steps=1), artifacts["shards"], str(reward), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="not a complete model artifact"):
        run(DPOConfig(**TRAIN, steps=1), artifacts["shards"], str(tmp_path), str(tmp_path / "b"))
    assert dpo_main(["--shards", "s", "--policy", "p", "--output", "o", "--beta", "0"]) == 1
    config = dataclasses.replace(DPOConfig(**TRAIN, steps=1), batch_size=12)
    with pytest.raises(ValueError, match="batch_size: 12 does not split over 8 devices"):
        run(config, artifacts["shards"], artifacts["sft"], str(tmp_path / "c"))


def test_cli_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        dpo_main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--shards", "--policy", "--output", "--beta", "--loss-type", "--label-smoothing"):
        assert flag in text
