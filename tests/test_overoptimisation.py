"""Over-optimisation seen without gold: the held-out split and reward model, the ensemble,
the ppo monitors, checkpoint selection and the early stop, the evaluation's figures and the
gate's rules (tiny models, 8 CPU devices)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

import components.sft as sft
from components.core.data.builtin_task import write_jsonl
from components.core.data.input_pipeline import read_manifest
from components.core.model.artifact import load_model
from components.core.rewards.members import Members, read_stats, reward_members
from components.core.training.metrics import read_metrics
from components.evaluate.config import EvalConfig
from components.evaluate.gate import decide
from components.evaluate.overoptimisation import overoptimisation_part
from components.evaluate.stage import run as evaluate
from components.ppo import PPOConfig
from components.ppo import run as ppo
from components.ppo.monitors import Monitors, OveroptTracker, monitor, stack
from components.reward import RewardConfig
from components.reward import run as train_reward
from components.shard import ShardConfig
from components.shard import run as shard
from components.shard.records import place, prompt_hash

TRAIN = dict(preset="tiny", batch_size=64, max_len=0, warmup_steps=10, eval_every=1000)
TRAIN.update(save_every=1000, report_to="none")


def test_the_heldout_split_takes_the_highest_positions_and_leaves_eval_alone():
    prompts = [f"prompt {i}" for i in range(2000)]
    without = [place(prompt_hash(p), 0.1, 4)[0] for p in prompts]
    with_heldout = [place(prompt_hash(p), 0.1, 4, 0.25)[0] for p in prompts]
    # Eval is the same prompts either way; heldout comes out of train only.
    assert [s == "eval" for s in without] == [s == "eval" for s in with_heldout]
    moved = [a for a, b in zip(without, with_heldout, strict=True) if b == "heldout"]
    assert set(moved) == {"train"}
    assert abs(len(moved) / len(prompts) - 0.25) < 0.03
    with pytest.raises(ValueError, match="heldout_fraction: 0.9 must be in"):
        ShardConfig(eval_fraction=0.2, heldout_fraction=0.9)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("overopt")
    write_jsonl(str(root / "pairs.jsonl"), 2000)
    paths = {name: str(root / name) for name in ("shards", "sft", "reward")}
    config = ShardConfig(num_shards=2, tokenizer="builtin-words", heldout_fraction=0.3)
    shard(config, [str(root / "pairs.jsonl")], paths["shards"])
    sft.run(sft.SFTConfig(steps=100, learning_rate=1e-2, **TRAIN), paths["shards"], paths["sft"])
    reward = RewardConfig(steps=60, learning_rate=3e-3, ensemble_size=2, **TRAIN)
    paths["reward_summary"] = train_reward(reward, paths["shards"], paths["reward"])
    return paths


def test_reward_stage_trains_the_heldout_model_and_the_ensemble(artifacts):
    manifest = read_manifest(artifacts["shards"])
    counts = manifest["counts"]
    assert counts["heldout"] > 0 and counts["train"] + counts["eval"] + counts["heldout"] == 2000
    members = reward_members(artifacts["reward"])
    assert members.heldout == os.path.join(artifacts["reward"], "heldout")
    assert members.ensemble == (os.path.join(artifacts["reward"], "ensemble", "1"),)
    stats = {
        name: json.load(open(os.path.join(folder, "reward_stats.json")))
        for name, folder in [("proxy", artifacts["reward"]), ("heldout", members.heldout),
                             ("member", members.ensemble[0])]
    }  # fmt: skip
    assert [s["trained_on"] for s in stats.values()] == ["train", "heldout", "train"]
    assert [s["seed"] for s in stats.values()] == [0, 0, 1]
    # Each learned the task (the gold ordering) on its own data.
    assert all(s["accuracy"] > 0.75 for s in stats.values()), stats
    summary = artifacts["reward_summary"]
    assert summary["heldout/eval/accuracy"] == stats["heldout"]["accuracy"]
    # Not the same model: another seed, other data.
    proxy, _ = load_model(artifacts["reward"], scalar_head=True)
    other, _ = load_model(members.heldout, scalar_head=True)
    assert not np.allclose(proxy.scalar_head.kernel[...], other.scalar_head.kernel[...])


def _pmapped_monitor(proxy, members, spec):
    devices = jax.local_device_count()
    split = lambda a: np.asarray(a, np.float32).reshape(devices, -1)  # noqa: E731
    stacked = np.stack([split(m) for m in members], axis=1)  # [D, M, B/D]
    run = jax.pmap(lambda p, m: monitor(p, m, spec), axis_name="data")
    train, figures = run(split(proxy), stacked)
    return np.asarray(train).reshape(-1), {k: float(v[0]) for k, v in figures.items()}


def test_monitor_figures_and_the_conservative_rewards():
    rng = np.random.default_rng(0)
    proxy = rng.normal(2.0, 3.0, 16)
    heldout, member = rng.normal(0.0, 1.0, 16), rng.normal(1.0, 2.0, 16)
    stats = ((2.0, 3.0), ((0.0, 1.0), (1.0, 2.0)))
    z = np.stack([(proxy - 2.0) / 3.0, (member - 1.0) / 2.0])
    for kind, combined in [
        ("", z[0]),
        ("mean", z.mean(0)),
        ("min", z.min(0)),
        ("mean-std", z.mean(0) - 0.5 * z.std(0, ddof=1)),
    ]:
        spec = Monitors(*stats, heldout=True, conservative=kind, weight=0.5)
        train, figures = _pmapped_monitor(proxy, [heldout, member], spec)
        np.testing.assert_allclose(train, 2.0 + 3.0 * combined, rtol=1e-5, atol=1e-5)
        assert figures["overopt/proxy_score"] == pytest.approx(z[0].mean(), abs=1e-5)
        assert figures["overopt/heldout_score"] == pytest.approx(heldout.mean(), abs=1e-5)
        spread = z.std(0, ddof=1).mean()
        assert figures["overopt/ensemble_std"] == pytest.approx(spread, rel=1e-5)


def test_tracker_gains_gap_and_early_stop():
    tracker = OveroptTracker(patience=3, heldout=True, tolerance=0.2)
    # The held-out score peaks at iteration 3 while the proxy keeps rising; averaged over 3
    # rollouts (from iteration 2): 0.1, 0.3, 0.4 (the best, to iteration 4), 0.333, 0.233,
    # 0.133, 0.133.
    heldout = [0.0, 0.1, 0.2, 0.6, 0.4, 0.0, 0.3, 0.1, 0.0]
    stops = []
    for it, score in enumerate(heldout):
        rollout = {"overopt/proxy_score": 0.1 * it, "overopt/heldout_score": score}
        gains = tracker.gains(rollout)
        assert gains["overopt/gap"] == pytest.approx(0.1 * it - score)
        stops.append(tracker.observe(it, rollout))
    # Iteration 6: 0.4 - 0.233 is within the tolerance; iteration 7: 0.4 - 0.133 > 0.2.
    assert stops == [False] * 7 + [True, True]
    assert "is 0.1333, more than 0.2 (heldout_tolerance) below its best average 0.4 (to " \
        "iteration 4)" in tracker.stop_reason(7)  # fmt: skip
    again = OveroptTracker(patience=3, heldout=True, tolerance=0.2)
    again.restore(json.loads(json.dumps(tracker.state())))
    assert again.state() == tracker.state()
    assert again.observe(9, {"overopt/proxy_score": 1.0, "overopt/heldout_score": 0.0})
    # One noisy rollout on a plateau (the old rule, below the best for N rollouts, stopped
    # every seed of bench_overoptimisation's noisy setting) stays within the tolerance.
    plateau = OveroptTracker(patience=3, heldout=True, tolerance=0.2)
    for it, score in enumerate([0.9, 1.0, 1.2, 0.95, 1.0, 0.9, 1.05, 0.95, 0.9, 1.0]):
        assert not plateau.observe(it, {"overopt/proxy_score": 1 + 0.01 * it,
                                        "overopt/heldout_score": score})  # fmt: skip
    # A proxy that fell with it is no hacking: no stop.
    falling = OveroptTracker(patience=1, heldout=True, tolerance=0.0)
    for it, score in enumerate([0.5, 0.4, 0.3]):
        rollout = {"overopt/proxy_score": score, "overopt/heldout_score": score}
        falling.gains(rollout)
        assert not falling.observe(it, rollout)
    off = OveroptTracker(patience=0, heldout=True)
    assert not any(off.observe(it, {"overopt/proxy_score": it, "overopt/heldout_score": -it})
                   for it in range(5))  # fmt: skip


# heldout_patience longer than the run: the early stop's tracker keeps every rollout's scores
# and never stops.
ALIGNED = PPOConfig(
    iterations=8, rollout_batch_size=64, minibatches=2, learning_rate=1e-3, save_every=2,
    heldout_patience=20, report_to="none",
)  # fmt: skip


@pytest.fixture(scope="module")
def aligned(artifacts, tmp_path_factory) -> str:
    output = str(tmp_path_factory.mktemp("ppo"))
    ppo(ALIGNED, artifacts["shards"], artifacts["sft"], artifacts["reward"], output)
    return output


def test_ppo_logs_the_monitors_and_outputs_the_policy_the_heldout_model_chose(artifacts, aligned):
    rows = [row for row in read_metrics(aligned) if "overopt/proxy_score" in row]
    assert len(rows) == 8
    for name in ("heldout_score", "ensemble_std", "proxy_gain", "heldout_gain", "gap"):
        assert all(np.isfinite(row[f"overopt/{name}"]) for row in rows), name
    assert rows[0]["overopt/proxy_gain"] == 0.0 and rows[0]["overopt/gap"] == 0.0
    for row in rows:  # over every real token of the rollout: TRL's per-response sum / length
        per_token = row["objective/entropy"] / row["response_length"]
        assert row["objective/entropy_per_token"] == pytest.approx(per_token, rel=1e-5)
    # Alignment raised both models' scores: the held-out model agrees it improved.
    assert rows[-1]["overopt/heldout_gain"] > 0.1
    status = json.load(open(os.path.join(aligned, "ppo_status.json")))
    selected = status["selected_checkpoint"]
    # Saved every 2 iterations, each ranked by the held-out model on the held-out prompts
    # (select_prompts); the figures logged at step k + 1 are iteration k's, and the last
    # save's (iteration 8) is in the status.
    saved = {
        int(row["step"]) - 1: row["overopt/selection_score"]
        for row in rows if "overopt/selection_score" in row
    }  # fmt: skip
    assert sorted(saved) == [0, 2, 4, 6]
    saved[8] = selected["last_selection_score"]
    best = max(saved, key=saved.get)
    assert selected["iteration"] == best and selected["last_iteration"] == 8
    assert selected["selection_score"] == pytest.approx(saved[best])
    # Alignment raised it: the sft policy (iteration 0) scored lowest.
    assert saved[0] < min(saved[k] for k in (4, 6, 8)) - 0.1, saved


def test_a_resumed_run_selects_and_tracks_as_the_uninterrupted_one(artifacts, aligned, tmp_path):
    """Killed after its save at iteration 4, the run rolls iteration 4 out again on resume:
    the early stop's tracker counts it once, and the save keeps the score it was ranked by."""
    output = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(aligned, "work"), os.path.join(output, "work"))
    folder = os.path.join(output, "work", "checkpoints")
    for step in os.listdir(folder):
        if step.isdigit() and int(step) > 4:
            shutil.rmtree(os.path.join(folder, step))
    ppo(ALIGNED, artifacts["shards"], artifacts["sft"], artifacts["reward"], output)

    def tracker(run: str) -> dict:
        with open(os.path.join(run, "work", "checkpoints", "8", "meta", "metadata")) as f:
            return json.load(f)["extra"]["overoptimisation"]

    assert tracker(output) == tracker(aligned)  # before the fix, iteration 4's twice
    # Iterations 0-7's (held-out, proxy) scores: the save holds the tracker before its own.
    assert len(tracker(aligned)["window"]) == 8
    status = [json.load(open(os.path.join(run, "ppo_status.json"))) for run in (aligned, output)]
    assert status[1]["selected_checkpoint"] == status[0]["selected_checkpoint"]
    scored = [
        {row["step"]: row["overopt/selection_score"]
         for row in read_metrics(run) if "overopt/selection_score" in row}
        for run in (aligned, output)
    ]  # fmt: skip
    assert scored[1] == {k: v for k, v in scored[0].items() if k > 4}  # step 5: iteration 4's
    assert 5 in scored[1]


def test_the_selection_score_is_the_same_for_the_same_policy(artifacts):
    """Every save is sampled with the same keys: a policy's score depends on it alone."""
    from flax import nnx

    from components.core.model.eval_sampling import SamplingSettings
    from components.core.training import parallel
    from components.ppo.selection import HeldoutSelection

    policy, _ = load_model(artifacts["sft"])
    folder = reward_members(artifacts["reward"]).heldout
    heldout, _ = load_model(folder, scalar_head=True)
    stats = read_stats(folder)
    manifest = read_manifest(artifacts["shards"])
    tokenizer = manifest["tokenizer"]
    settings = SamplingSettings(12, tokenizer["eos_id"], tokenizer["pad_id"], 1.0)
    graphs = (nnx.split(policy, nnx.Param)[0], nnx.split(heldout, nnx.Param)[0])
    select = HeldoutSelection.build(
        artifacts["shards"], graphs, 1, (stats["mean"], stats["std"]), settings, prompts=40,
        samples=2, prompt_len=16, seed=3, batch_size=32,
    )  # fmt: skip
    assert len(select.prompts.tokens) == 40
    params = parallel.place(nnx.split(policy, nnx.Param)[1])
    proxy, _ = load_model(artifacts["reward"], scalar_head=True)
    # Stacked as the loop holds the monitors; member 1 is the held-out model here.
    members = parallel.place(stack([nnx.split(m, nnx.Param)[1] for m in (proxy, heldout)]))
    first, again = select.score(params, members), select.score(params, members)
    assert first == again and np.isfinite(first)
    other = dataclasses.replace(select, seed=select.seed + 1)
    assert other.score(params, members) != first  # other keys, other samples
    # The held-out model's own z, as the evaluate stage's response_rewards would give it.
    alone = dataclasses.replace(select, member=None)
    assert alone.score(params, parallel.place(nnx.split(heldout, nnx.Param)[1])) == first


def test_evaluate_measures_overoptimisation_and_the_gate_reads_it(artifacts, aligned, tmp_path):
    config = EvalConfig(
        max_eval_prompts=48, samples_per_prompt=2, best_of_n="1,2", bootstrap_samples=200,
        report_to="none",
    )  # fmt: skip
    summary = evaluate(
        config, artifacts["shards"], aligned, artifacts["sft"], artifacts["reward"], str(tmp_path)
    )
    part = summary["overoptimisation"]
    assert part["heldout_gain"]["difference"]["value"] > 0
    assert part["disagreement"]["members"] == 2 and part["length_ratio"] > 0
    reasons = json.load(open(tmp_path / "eval.json"))["reasons"]
    assert any("judged by the held-out reward model" in r for r in reasons)
    assert any("reward-ensemble spread over the reference's" in r for r in reasons)
    page = (tmp_path / "report.html").read_text()
    assert "<h2>Over-optimisation</h2>" in page and "drift monitors per rollout" in page


def _hacked(**changes):
    """A summary that passes every rule, with ``changes`` to the over-optimisation part."""
    part = {
        "length_ratio": 1.1,
        "proxy_gain": {"difference": {"value": 0.8}},
        "heldout_gain": {"difference": {"value": 0.5}},
        "gap": 0.3,
        "disagreement": {"aligned": 0.3, "reference": 0.25, "ratio": 1.2, "members": 3},
    }
    part.update(changes)
    return {
        "win_rate": {"value": 0.7, "low": 0.62, "high": 0.8},
        "kl": {"per_token": 0.1},
        "gold": None,
        "overoptimisation": part,
    }


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({}, None),
        ({"length_ratio": 3.4}, "response length over the reference's 3.40x > 3.00x: fail"),
        (
            {"heldout_gain": {"difference": {"value": -0.2}}},
            "reward gain judged by the held-out reward model -0.20 std ≤ 0.00 std: fail",
        ),
        ({"gap": 1.6}, "judge's gain minus the held-out reward model's 1.60 std > 1.00 std: fail"),
        (
            {"disagreement": {"ratio": 2.5}},
            "reward-ensemble spread over the reference's 2.50x > 2.00x: fail",
        ),
        (  # not measured is not passed
            {"length_ratio": None},
            "response length over the reference's is None, not a finite number: fail",
        ),
    ],
)
def test_each_gate_rule_refuses_a_synthetic_hacked_policy(changes, reason):
    gate = decide(_hacked(**changes), EvalConfig())
    assert gate.blessed is (reason is None)
    if reason:
        assert reason in gate.reasons
    off = EvalConfig(
        min_heldout_gain=-float("inf"), max_reward_gap=float("inf"),
        max_length_ratio=float("inf"), max_disagreement=float("inf"),
    )  # fmt: skip
    assert decide(_hacked(**changes), off).blessed
    # inf turns each off; min_heldout_gain's off is -inf, and +inf, which no gain exceeds,
    # is refused rather than read as off.
    with pytest.raises(ValueError, match="min_heldout_gain: inf would refuse every policy"):
        EvalConfig(min_heldout_gain=float("inf"))


def test_overoptimisation_part_from_scores():
    rng = np.random.default_rng(1)
    mask = np.ones((40, 2, 5), np.int32)
    short = mask.copy()
    short[..., 3:] = 0
    proxy = (rng.normal(3.0, 1.0, (40, 2)) * 2.0 + 1.0, rng.normal(0.0, 1.0, (40, 2)) * 2.0 + 1.0)
    heldout = [rng.normal(0.5, 1.0, (40, 2)), rng.normal(0.0, 1.0, (40, 2))]
    member = [rng.normal(0.0, 3.0, (40, 2)), rng.normal(0.0, 1.0, (40, 2))]
    part = overoptimisation_part(
        mask, short, proxy=proxy, proxy_stats={"mean": 1.0, "std": 2.0},
        members=Members(heldout="h", ensemble=("e",)), member_z=[heldout, member],
        bootstrap={"n_resamples": 100, "confidence": 0.9, "seed": 0},
    )  # fmt: skip
    assert part["length_ratio"] == pytest.approx(5 / 3)
    proxy_gain = part["proxy_gain"]["difference"]["value"]
    assert proxy_gain == pytest.approx(3.0, abs=0.4)
    assert part["gap"] == pytest.approx(proxy_gain - part["heldout_gain"]["difference"]["value"])
    assert part["disagreement"]["ratio"] > 1.5  # the aligned samples: z 3 apart, and noisier


def test_the_planner_counts_the_monitors_and_refuses_what_does_not_fit():
    from pipelines.dag import fit, run_presets

    preset = run_presets.RUN_PRESETS["v5e-8-1b"]
    totals = []
    for values in ({}, {"heldout_reward": 0.2}, {"heldout_reward": 0.2, "reward_ensemble": 3}):
        applied, stages = fit.applied(preset, values)
        totals.append(fit._total(applied, "ppo", stages["ppo"]))
    # One more 1B model in bf16 per member: 2 bytes x 1.24e9 parameters each.
    member = 2 * 1_235_814_400
    assert totals[1] - totals[0] == pytest.approx(member, rel=0.01)
    assert totals[2] - totals[0] == pytest.approx(3 * member, rel=0.01)
    fit.check(preset, {"heldout_reward": 0.2})  # fits a v5e-8
    with pytest.raises(fit.FitError, match=r"ppo needs 18.4 GiB per chip.*--lora-rank 16"):
        fit.check(preset, {"heldout_reward": 0.2, "reward_ensemble": 3})


def test_the_demo_task_holds_a_heldout_reward_model_where_a_run_can():
    from pipelines.dag.tasks import with_task

    values, sources = with_task({}, {})
    assert values["heldout_reward"] == 0.2 and sources["heldout_reward"] == "task"
    for given in ({"data_uri": "pairs.jsonl"}, {"fsdp": True}, {"algorithm": "dpo"},
                  {"train_reward_model": False}):  # fmt: skip
        assert "heldout_reward" not in with_task(given, {})[0], given
    assert with_task({"heldout_reward": 0.0}, {"heldout_reward": "flag"})[0]["heldout_reward"] == 0


def test_a_rerun_repeats_the_recorded_run_without_the_task_defaults(monkeypatch):
    import argparse

    import pipelines.targets.local.run as local
    from pipelines.cli import run as cli_run

    recorded = {"task": "arithmetic", "train_reward_model": False}
    monkeypatch.setattr(local, "last_values", lambda runs_dir: dict(recorded))
    values, sources = cli_run._rerun_values(argparse.Namespace(runs_dir="runs", run=None))
    assert values == recorded and set(sources.values()) == {"last run"}
    # A task named anew brings its settings under the flags.
    args = argparse.Namespace(runs_dir="runs", run=None, param_task="")
    values, sources = cli_run._rerun_values(args)
    assert values["heldout_reward"] == 0.2 and sources["heldout_reward"] == "task"
