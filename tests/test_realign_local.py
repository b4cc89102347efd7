"""Periodic realignment simulated with kfp.local: scheduled runs on growing data, one root.

The root is seeded with the original policy (version 1, every later run's anchor), and each
run warm-starts from the root (base_policy = promoted_policy_uri), as a schedule does. DPO
judged by the gold reward keeps each run to one training task (no reward model).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from flax import nnx

from components.core.data.builtin_task import GOLD_REWARD_NAME, write_jsonl
from components.core.data.tokenizers import BUILTIN_WORDS, load_tokenizer
from components.core.model.artifact import create_model, save_model
from pipelines.cli.main import main
from pipelines.releases import promotion
from pipelines.targets.local.result import format_summary
from pipelines.targets.local.run import run_local

# The smallest run that trains: tiny model, 4 DPO steps, 16 eval prompts, no best-of-n.
REALIGN = {
    "tokenizer": BUILTIN_WORDS,
    "gold_reward": GOLD_REWARD_NAME,
    "algorithm": "dpo",
    "num_shards": 2,
    "eval_fraction": 0.2,
    "max_prompt_tokens": 48,
    "max_response_tokens": 48,
    "dpo_steps": 4,
    "dpo_batch_size": 16,
    "dpo_learning_rate": 3e-3,  # from scratch: drift that the anchor KL shows above its noise
    "min_eval_pairs": 16,
    "eval_max_new_tokens": 16,
    "max_eval_prompts": 16,
    "eval_samples_per_prompt": 2,
    "best_of_n": "",
    "min_win_rate_lower": 0.0,  # bless what comes out: the drift, not the gain, is tested
}
TRAINED = {"find-data", "plan-run", "shard", "check-policy", "given-policy", "dpo", "evaluate"}
TRAINED |= {"promote"}


def _seed_root(tmp_path: Path) -> Path:
    """A root whose version 1 is an untrained tiny policy: the original, the anchor."""
    tokenizer = load_tokenizer(BUILTIN_WORDS)
    model = create_model("tiny", tokenizer.vocab_size, scalar_head=False, seed=0)
    original = tmp_path / "original"
    save_model(str(original), model, nnx.state(model, nnx.Param), tokenizer=tokenizer.info(),
               stage="sft", training={}, step=0)  # fmt: skip
    root = tmp_path / "promoted"
    assert main(["promote", str(original), "--to", str(root), "--note", "original"]) == 0
    return root


def _run(tmp_path: Path, root: Path, **values) -> object:
    started = time.monotonic()
    settings = {**REALIGN, "data_uri": str(tmp_path / "data" / "*.jsonl"),
                "base_policy": str(root), "promoted_policy_uri": str(root), **values}  # fmt: skip
    result = run_local(settings, runs_dir=tmp_path / "runs", echo=False)
    assert not result.error, result.error
    print(f"run: {time.monotonic() - started:.0f} s, executed {sorted(result.executed)}")
    return result


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scheduled_runs_drift_skip_roll_back_and_stop_at_the_anchor_limit(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("ALIGNPIPE_CPU_DEVICES", "8")
    root = _seed_root(tmp_path)
    (tmp_path / "data").mkdir()
    drift = []
    for week in (1, 2, 3):  # each week's file joins the glob
        write_jsonl(str(tmp_path / "data" / f"week-{week}.jsonl"), 150, seed=week)
        result = _run(tmp_path, root)
        assert result.executed == TRAINED
        assert result.stages["sft"].task == "given-policy"  # the warm start stands for sft
        figures = result.figures()
        assert figures["blessed"] == 1.0 and figures["status"] == "evaluated"
        assert bool(figures["anchor_is_reference"]) is (week == 1)  # week 1 starts at the anchor
        drift.append(figures["anchor_kl_per_token"])
        summary = format_summary(result)
        assert "KL to the anchor" in summary and "(judged by the gold reward)" in summary
    assert promotion.complete_versions(str(root)) == [1, 2, 3, 4]
    assert drift[0] < drift[1] < drift[2], drift  # each week drifts further from the original
    history = promotion.read_history(str(root))
    assert [e["figures"]["anchor/kl/per_token"] for e in history[1:]] == pytest.approx(drift)
    assert [len(e["data"]) for e in history[1:]] == [1, 2, 3]
    report = Path(figures["report"]).read_text()
    assert "Drift from the anchor" in report and "version 3" in report  # past promotions

    # Week 4: no new file. Nothing trains; the run says so.
    quiet = _run(tmp_path, root)
    assert quiet.executed == {"find-data", "plan-run", "no-new-data"}
    assert quiet.figures()["status"] == "no new data"
    assert "no new data: nothing trained" in format_summary(quiet)
    assert promotion.complete_versions(str(root)) == [1, 2, 3, 4]

    capsys.readouterr()
    assert main(["history", str(root)]) == 0
    table = capsys.readouterr().out
    print(table)
    assert "anchor KL" in table and table.count("promotion") == 4

    # Roll back to version 2; a forced run from it drifts past a tight anchor limit: refused.
    assert main(["rollback", str(root), "--to", "2", "--reason", "drifted"]) == 0
    assert promotion.current_version(str(root)) == 2
    assert promotion.read_history(str(root))[-1]["event"] == "rollback"
    capped = _run(tmp_path, root, force_run=True, max_anchor_kl=drift[0] / 2)
    figures = capped.figures()
    assert {"dpo", "evaluate"} <= capped.executed and "promote" not in capped.executed
    assert figures["blessed"] == 0.0
    assert any("KL to the anchor" in r and r.endswith("fail") for r in figures["gate"])
    assert promotion.current_version(str(root)) == 2
    assert promotion.complete_versions(str(root)) == [1, 2, 3, 4]
