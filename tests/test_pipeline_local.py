"""The pipeline end to end under kfp.local on the tiny preset, and what the cache reuses."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pipelines import stage_io
from pipelines.cli.main import main
from pipelines.releases import policies
from pipelines.targets.local import run_log
from pipelines.targets.local.result import format_summary
from pipelines.targets.local.run import (
    PROMOTED_DIR,
    TaskWatcher,
    failure_reasons,
    run_local,
)

# Tiny model, few steps, little data: the whole pipeline in a couple of minutes on 2 cores.
TINY = {
    "preset": "tiny",
    "builtin_pairs": 200,
    "num_shards": 2,
    "max_prompt_tokens": 48,
    "max_response_tokens": 48,
    "sft_steps": 4,
    "sft_batch_size": 16,
    "reward_steps": 4,
    "reward_batch_size": 16,
    "ppo_iterations": 2,
    "ppo_rollout_batch_size": 16,
    "ppo_epochs": 1,
    "max_new_tokens": 16,
    "eval_max_new_tokens": 16,
    "max_eval_prompts": 16,
    # The smallest baseline that still gives a frontier: evaluate runs in four of the runs.
    "eval_samples_per_prompt": 2,
    "best_of_n": "1,2",
    "min_eval_pairs": 16,  # one eval batch of sft and reward
    # Four reward steps rank little; the gate has its own test below.
    "min_reward_accuracy": 0.0,
    # Bless whatever comes out, so the promotion branch runs too.
    "min_win_rate_lower": 0.0,
}
# plan-run (never cached) decides whether the data is new and which policy is the anchor;
# check-policy (never cached) whether sft trains the initial policy.
ALL_TASKS = {"plan-run", "builtin-data", "shard", "check-policy", "sft", "reward", "ppo"}
ALL_TASKS |= {"evaluate", "promote"}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    """One pipeline root for the module: later tests reuse the first one's cached tasks."""
    return tmp_path_factory.mktemp("runs")


def _statuses(result) -> dict[str, str]:
    return {stage: record.status for stage, record in result.stages.items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_run_cache_and_rerun(runs_dir, monkeypatch, capsys):
    tmp_path = runs_dir
    monkeypatch.setenv("ALIGNPIPE_CPU_DEVICES", "8")
    first = run_local(TINY, runs_dir=tmp_path, echo=False)
    assert not first.error, first.error
    assert first.executed == ALL_TASKS
    # The tasks' whole output is in the run folder's log, off the terminal: executor inputs,
    # kfp.local's own records, not Orbax's INFO lines (--verbose keeps them); Beam never
    # tried Prism (offline).
    assert first.log == first.run_dir / "run.log" and not any(tmp_path.glob("running-*"))
    log = first.log.read_text()
    assert "Got executor_input" in log and "Finished saving checkpoint" not in log
    assert "Executing task 'ppo'" in log and "Cleaned up workspace" in log
    assert "PrismRunner" not in log and "\x1b[" not in log
    assert {s: v for s, v in _statuses(first).items() if v != "ran"} == {"dpo": "skipped"}
    figures = first.figures()
    assert 0.0 <= figures["reward_accuracy"] <= 1.0
    assert 0.0 <= figures["win_rate_low"] <= figures["win_rate"] <= figures["win_rate_high"]
    assert figures["gold_gain"] is not None and figures["kl_per_token"] is not None
    assert 0.0 <= figures["gold_win_rate_low"] <= figures["gold_win_rate"] <= 1.0
    assert figures["blessed"] == 1.0
    assert "<html" in Path(figures["report"]).read_text().lower()
    promoted = tmp_path / PROMOTED_DIR
    current = Path(stage_io.reference_uri(policies.check_policy(str(promoted))))
    assert current == promoted / "versions" / "000001"
    assert (current / "config.json").exists() and (current / "params").is_dir()
    record = json.loads((current / "PROMOTED.json").read_text())
    assert record["source"].endswith("ppo/model") and record["algorithm"] == "ppo"
    assert record["run_id"] == first.run_dir.name and len(record["data_fingerprint"]) == 16
    assert record["figures"]["win_rate/value"] == figures["win_rate"]

    # The run's record: every parameter with its source, versions, inputs, stages, outcome.
    run = json.loads((first.run_dir / "run.json").read_text())
    assert run["outcome"] == "succeeded" and run["code"]["alignpipe"]
    assert run["libraries"]["jax"] and run["stages"]["ppo"]["status"] == "ran"
    assert run["parameters"]["ppo_iterations"] == {"value": 2, "source": "flag"}
    assert run["parameters"]["kl_coef"]["source"] == "default"
    assert run["parameters"]["kl_coef"]["value"] != 0.05

    # One PPO parameter changed: shard, sft and reward come from the cache.
    second = run_local({**TINY, "kl_coef": 0.05}, runs_dir=tmp_path, echo=False)
    assert not second.error, second.error
    # promote follows evaluate whenever it blesses; nothing upstream of ppo executed.
    assert second.executed == {"plan-run", "check-policy", "ppo", "evaluate", "promote"}
    statuses = _statuses(second)
    assert [statuses[s] for s in ("data", "shard", "sft", "reward")] == ["cached"] * 4
    assert [statuses[s] for s in ("ppo", "evaluate")] == ["ran", "ran"]
    summary = format_summary(second)
    assert "reward     cached" in summary and "ppo        ran" in summary
    assert "(judged by the reward model)" in summary
    # The built-in task has a gold reward: it, not the reward model ppo trained against,
    # decides the gate; best-of-n's any-n curve is printed with the chord's and the bound's.
    assert "gate: win-rate lower bound (judged by the gold reward)" in summary
    assert "on its any-n curve;" in summary and "on the chord" in summary
    assert "on the bound)" in summary and "(independent pairs;" in summary
    assert "note: no gold reward" not in summary
    # The pairs behind the gold win rate, whose ties count half.
    outcomes = re.search(r"gold win rate .*\((\d+) wins, (\d+) ties, (\d+) losses\)", summary)
    assert outcomes and sum(map(int, outcomes.groups())) > 0

    # rerun --run FIRST --from evaluate: the first run's values again (its run.json),
    # caching off from evaluate on.
    capsys.readouterr()
    rerun = ["rerun", "--from", "evaluate", "--runs-dir", str(tmp_path)]
    assert main([*rerun, "--run", first.run_dir.name]) == 0
    printed, errors = capsys.readouterr()
    newest = json.loads(sorted(tmp_path.glob("alignpipe-*/run.json"))[-1].read_text())
    # The first run's given values come back as "last run"; its defaults stay defaults.
    assert newest["parameters"]["ppo_iterations"] == {"value": 2, "source": "last run"}
    assert newest["parameters"]["kl_coef"] == run["parameters"]["kl_coef"]
    assert main(["runs", "--runs-dir", str(tmp_path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert "ppo        cached" in printed and "evaluate   ran" in printed
    assert "win rate vs reference" in printed and "gold win rate" in printed
    assert "vs best-of-n" in printed
    # Quiet: a progress line per stage event and the summary, ending with the log's place.
    assert "[alignpipe] evaluate: running" in printed
    assert "[alignpipe] ppo: from the cache" in printed
    # Evaluation's sampling progress, at most one line per stage every 10 s.
    progress = [line for line in printed.splitlines() if re.match(r"\[alignpipe\] \w+: step", line)]
    assert progress and all(line.startswith("[alignpipe] evaluate: step") for line in progress)
    assert len(progress) <= 12
    assert len(printed.splitlines()) - len(progress) < 45 and errors == ""
    rerun_log = printed.splitlines()[-1].split()[-1]
    assert printed.splitlines()[-1].startswith("log ") and rerun_log.endswith("/run.log")
    assert "Got executor_input" in Path(rerun_log).read_text()

    # algorithm=dpo: the dpo branch replaces reward and ppo; shard and sft from the cache;
    # evaluate judges with the reward model it is given.
    reward_model = str(first.run_dir / "reward" / "model")
    dpo = {**TINY, "algorithm": "dpo", "dpo_steps": 4, "dpo_batch_size": 16}
    fourth = run_local({**dpo, "eval_reward_model": reward_model}, runs_dir=tmp_path, echo=False)
    assert not fourth.error, fourth.error
    assert fourth.executed == {"plan-run", "check-policy", "dpo", "evaluate", "promote"}
    statuses = _statuses(fourth)
    assert [statuses[s] for s in ("data", "shard", "sft")] == ["cached"] * 3
    assert [statuses[s] for s in ("reward", "ppo")] == ["skipped"] * 2
    figures = fourth.figures()
    assert figures["algorithm"] == "dpo" and figures["dpo_steps"] == 4
    assert figures["reward_accuracy"] is None and figures["kl_per_token"] > 0
    summary = format_summary(fourth)
    assert "dpo        ran" in summary and "4 steps, eval preference accuracy" in summary

    # A reward model trained apart judges a ppo policy too: only evaluate reruns, and its
    # eval.json names the given model, not the one ppo trained against.
    judge = str(tmp_path / "judge")
    shutil.copytree(reward_model, judge)
    fifth = run_local({**TINY, "kl_coef": 0.05, "eval_reward_model": judge},
                      runs_dir=tmp_path, echo=False)  # fmt: skip
    assert not fifth.error, fifth.error
    assert fifth.executed <= {"plan-run", "check-policy", "evaluate", "promote"}
    assert "evaluate" in fifth.executed
    evaluated = json.loads((fifth.run_dir / "evaluate" / "evaluation" / "eval.json").read_text())
    assert evaluated["summary"]["judge_model"] == judge

    # Warm starts from the promoted policy (given-policy standing for sft) run in
    # tests/test_realign_local.py, week after week.


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reward_gate_stops_the_local_run_before_ppo_with_its_reason(
    runs_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("ALIGNPIPE_CPU_DEVICES", "8")
    # Data, shard and sft come from the first test's cache when it ran; promote nowhere shared.
    values = {**TINY, "min_reward_accuracy": 1.0, "promoted_policy_uri": str(tmp_path / "p")}
    result = run_local(values, runs_dir=runs_dir, echo=False)
    assert result.error and result.executed <= {
        "plan-run",
        "builtin-data",
        "shard",
        "check-policy",
        "sft",
    }
    statuses = _statuses(result)
    assert statuses["reward"] == "failed"
    assert [statuses[s] for s in ("ppo", "evaluate", "promote")] == ["skipped"] * 3
    reason = result.reasons["reward"]
    assert "reward model eval accuracy" in reason and "below min_reward_accuracy 1" in reason
    assert "lower min_reward_accuracy" in reason
    # The task's own reason ends the summary, not only kfp.local's "Inner task failed".
    summary = format_summary(result).splitlines()
    assert summary[-1] == f"  reward: {reason}" and summary[-2] == "FAILED: reward (reward)"
    assert summary[-3] == f"log: {result.log}"
    # Read back from the log as well (how a task without a failure file is explained).
    assert reason in run_log.task_errors(result.log.read_text())["reward"]
    assert (result.run_dir / "reward" / "model" / "config.json").exists()  # kept to inspect
    assert not (tmp_path / "p").exists()


def test_a_gate_judged_by_the_trained_against_reward_model_is_flagged() -> None:
    from pipelines.targets.local.result import _independent_judge

    by_model = {"gate_judge": "reward_model"}
    assert "--eval-reward-model" in _independent_judge(by_model, {"eval_reward_model": ""})[0]
    assert _independent_judge(by_model, {"eval_reward_model": "gs://b/rm"}) == []
    assert _independent_judge({"gate_judge": "gold"}, {"eval_reward_model": ""}) == []


def test_a_failed_tasks_reason_reaches_the_summary(tmp_path):
    model = tmp_path / "reward" / "model"
    with pytest.raises(ValueError, match="too noisy"):
        with stage_io.failure_reason(str(model)):
            raise ValueError("too noisy")
    with pytest.raises(KeyError):  # a bug is no user's reason: no file, the traceback stays
        with stage_io.failure_reason(str(tmp_path / "ppo" / "model")):
            raise KeyError("x")
    assert failure_reasons(tmp_path) == {"reward": "too noisy"}


def test_the_shard_stage_names_its_beam_runner():
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    from components.shard.config import ShardConfig
    from components.shard.stage import pipeline_options

    # Unnamed, Beam's DirectRunner would first try to download a Prism binary.
    options = pipeline_options(ShardConfig(num_workers=2), [])
    assert options.view_as(StandardOptions).runner == "FnApiRunner"
    assert options.view_as(DirectOptions).direct_running_mode == "multi_processing"
    dataflow = pipeline_options(ShardConfig(), ["--runner=DataflowRunner"])
    assert dataflow.view_as(StandardOptions).runner == "DataflowRunner"


def test_watcher_reads_kfp_local_events():
    watcher = TaskWatcher(echo=False)
    events = [
        "Executing task \x1b[96m'ppo'\x1b[0m",
        "Task reward cache hit (key=0123456789ab); skipping execution.",
        "Task \x1b[96m'ppo'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m",
        "Executing task 'evaluate'",
        "Task 'evaluate' finished with status FAILURE",
    ]
    for message in events:
        watcher.filter(_record(message))
    assert watcher.records["reward"].status == "cached"
    assert watcher.records["ppo"].status == "ran"
    assert watcher.records["ppo"].seconds is not None
    assert watcher.records["evaluate"].status == "failed"
    assert watcher.records["shard"].status == "skipped"


def _record(message: str):
    import logging

    return logging.LogRecord("root", logging.INFO, __file__, 0, message, None, None)


def test_sources_policy_check_and_promotion(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl").write_text("{}\n")
    sources = stage_io.find_sources(f"{tmp_path}/*.jsonl")
    assert [Path(s["uri"]).name for s in sources] == ["a.jsonl", "b.jsonl"]
    assert all("@" in s["fingerprint"] for s in sources)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        stage_io.find_sources(f"{tmp_path}/*.parquet")

    policy = tmp_path / "policy"
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        policies.check_policy(str(policy))
    (policy / "params").mkdir(parents=True)
    (policy / "params" / "weights").write_text("w")
    (policy / "config.json").write_text("{}")
    assert stage_io.reference_uri(policies.check_policy(str(policy))) == str(policy)

    destination = tmp_path / "promoted"
    assert policies.promote(str(policy), str(tmp_path / "artifact"), str(destination)) == 1
    version = destination / "versions" / "000001"
    assert (version / "params" / "weights").read_text() == "w"
    assert json.loads((version / "PROMOTED.json").read_text())["source"] == str(policy)
    assert stage_io.reference_uri(policies.check_policy(str(destination))) == str(version)
    assert (tmp_path / "artifact" / "config.json").exists()


def test_run_refuses_bad_parameters_before_running(tmp_path, capsys):
    argv = ["run", "--runs-dir", str(tmp_path), "--preset", "tiny", "--sft-batch-size", "12"]
    assert main(argv) == 2
    assert "sft_batch_size: 12 does not split over 8 chips" in capsys.readouterr().err
    assert not any(tmp_path.glob("alignpipe-*"))
    assert main(["rerun", "--from", "ppo", "--runs-dir", str(tmp_path / "none")]) == 2
