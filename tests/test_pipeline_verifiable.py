"""``alignpipe run --task arithmetic`` under kfp.local: the built-in reasoning task's data and
its solutions sharded apart, sft on the solutions, GRPO scored by builtin/exact-match with
no reward stage, the verifiable evaluation and its gate, and the summary's accuracy lines."""

from __future__ import annotations

import json

import pytest

from pipelines.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# The task's settings (pipelines/dag/tasks.py) at the tiny preset and a few iterations.
SMALL = ["--preset", "tiny", "--sft-steps", "300", "--ppo-iterations", "10",
         "--ppo-learning-rate", "3e-4", "--max-eval-prompts", "32"]  # fmt: skip


def test_the_arithmetic_task_runs_without_a_reward_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ALIGNPIPE_CPU_DEVICES", "8")
    code = main(["run", "--task", "arithmetic", "--runs-dir", str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["reward"][0] == "skipped" and lines["dpo"][0] == "skipped"
    assert lines["ppo"][0] == "ran" and lines["ppo"][-1] == "ppo-2"
    assert "accuracy" in lines and "judged by the reward function exact_match" in out
    assert "pass@8" in out and "win rate vs reference" not in out
    run_dir = next(tmp_path.glob("alignpipe-*"))
    run = json.loads((run_dir / "run.json").read_text())
    assert run["parameters"]["reward_functions"] == {
        "value": "builtin/exact-match", "source": "task",
    }  # fmt: skip
    assert run["parameters"]["ppo_iterations"]["source"] == "flag"
    # The solutions were sharded apart, with the prompts' split: sft read them.
    sft = json.loads((run_dir / "sft" / "model" / "config.json").read_text())
    shards = json.loads((run_dir / "shard" / "sft_shards" / "manifest.json").read_text())
    assert (
        shards["kind"] == "completion_shards"
        and shards["counts"]["train"] + shards["counts"]["eval"] == 128
    )
    assert sft["training"]["steps"] == 300
    record = json.loads((run_dir / "evaluate" / "evaluation" / "eval.json").read_text())
    summary = record["summary"]
    assert summary["kind"] == "verifiable" and summary["prompts"] == 32
    assert 0.0 <= summary["accuracy"] <= 1.0
    assert record["gate_judge"].startswith("reward function exact_match") or "exact_match" in (
        " ".join(record["reasons"])
    )
