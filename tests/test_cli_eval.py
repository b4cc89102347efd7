"""``alignpipe evaluate`` and ``alignpipe report`` as a user runs them."""

import json
import os
import shutil

import pytest
from flax import nnx

from components import shard
from components.core.data.builtin_task import write_jsonl
from components.core.model.artifact import create_model, save_model
from components.shard import ShardConfig
from pipelines.cli import model as cli_model
from pipelines.cli.main import main


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Shards plus untrained tiny policy and reward models (the CLI, not training, is tested)."""
    root = tmp_path_factory.mktemp("cli_eval")
    write_jsonl(str(root / "pairs.jsonl"), 200)
    shards = str(root / "shards")
    manifest = shard.run(
        ShardConfig(num_shards=2, eval_fraction=0.2), [str(root / "pairs.jsonl")], shards
    )
    vocab = manifest["tokenizer"]["vocab_size"]
    for name, head in (("policy", False), ("rm", True)):
        model = create_model("tiny", vocab, scalar_head=head, seed=0)
        save_model(
            str(root / name), model, nnx.state(model, nnx.Param), tokenizer=manifest["tokenizer"],
            stage="reward" if head else "sft", training={}, step=0,
        )  # fmt: skip
    return {"shards": shards, "policy": str(root / "policy"), "rm": str(root / "rm"), "root": root}


def _evaluate_args(a, output, policy=None):
    return [
        "evaluate", "--shards", a["shards"], "--policy", policy or a["policy"],
        "--reference", a["policy"], "--reward-model", a["rm"], "--output", output,
        "--max-new-tokens", "16", "--bootstrap-samples", "50", "--greedy",
    ]  # fmt: skip


def test_evaluate_runs_the_stage_and_report_finds_it(artifacts, capsys):
    run_dir = artifacts["root"] / "run"
    output = str(run_dir / "evaluate" / "out")
    assert main(_evaluate_args(artifacts, output)) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The same policy on both sides: every comparison ties, KL 0, and nothing was gained,
    # so it is not blessed (the win rate's lower bound 0.5 must exceed 0.5).
    assert printed["blessed"] is False
    assert printed["kl"]["per_token"] == 0.0
    # Greedy: every sample of a policy is its one answer, so all 4 x 4 pairs count and tie.
    assert printed["win_rate"] == {
        "value": 0.5, "low": 0.5, "high": 0.5, "wins": 0, "ties": printed["num_prompts"] * 16,
        "losses": 0, "pairing": "independent", "pairs": printed["num_prompts"] * 16,
        "coupled": None,
    }  # fmt: skip
    record = json.load(open(f"{output}/eval.json"))
    assert record["blessed"] is False
    # The built-in task's gold reward decides the win-rate rule (it ties too).
    reason = "win-rate lower bound (judged by the gold reward) 0.50 ≤ 0.50: fail"
    assert record["reasons"][0] == reason and record["gate_judge"] == "gold"
    assert record["summary"]["best_of_n"] is None  # greedy: n answers would be one answer
    lines = open(f"{output}/samples.jsonl", encoding="utf-8").read().splitlines()
    assert len(lines) == printed["num_prompts"] * 4  # the default samples per prompt
    assert {json.loads(line)["sample"] for line in lines} == {0, 1, 2, 3}
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == os.path.abspath(f"{output}/report.html")


def test_evaluate_without_a_reward_model_uses_the_gold_reward(artifacts, tmp_path, capsys):
    args = _evaluate_args(artifacts, str(tmp_path / "gold"))
    at = args.index("--reward-model")
    del args[at : at + 2]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["judge"] == "gold" and printed["reward_model_accuracy"] is None
    assert printed["win_rate"] == printed["gold"]["win_rate"]
    # Data without a built-in gold reward: nothing could judge, said in one line.
    shards = str(tmp_path / "shards")
    shutil.copytree(artifacts["shards"], shards)
    manifest = json.load(open(f"{shards}/manifest.json"))
    json.dump({**manifest, "gold_reward": None}, open(f"{shards}/manifest.json", "w"))
    args[args.index(artifacts["shards"])] = shards
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error: nothing to judge the responses with" in err
    assert "pass --reward-model (a reward model folder) or --gold-reward" in err


def test_evaluate_reports_a_missing_model_in_one_line(artifacts, tmp_path, capsys):
    args = _evaluate_args(artifacts, str(tmp_path / "o"), policy=str(tmp_path / "nothing"))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "config.json not found" in err
    assert not (tmp_path / "o").exists()


def test_evaluate_help_lists_the_config_flags(capsys):
    with pytest.raises(SystemExit) as done:
        main(["evaluate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    flags = ("--reference", "--max-kl", "--min-win-rate-lower", "--samples-per-prompt")
    for flag in (*flags, "--best-of-n", "--gold-reward"):
        assert flag in out
    text = " ".join(out.split())  # argparse wraps lines
    assert "[--reward-model REWARD_DIR]" in text and "'' (the default): the gold reward" in text


def _report_at(folder, mtime):
    folder.mkdir(parents=True)
    path = folder / "report.html"
    path.write_text("<!DOCTYPE html><html></html>")
    os.utime(path, (mtime, mtime))
    return str(path)


def test_report_lists_newest_first_and_opens_the_newest(tmp_path, capsys, monkeypatch):
    old = _report_at(tmp_path / "a" / "evaluate", 1_000_000)
    new = _report_at(tmp_path / "b" / "deep" / "evaluate", 2_000_000)
    (tmp_path / "c").mkdir()  # a link to a report since deleted is skipped, not a traceback
    (tmp_path / "c" / "report.html").symlink_to(tmp_path / "gone.html")
    assert cli_model.find_reports(str(tmp_path)) == [new, old]
    opened = []
    monkeypatch.setattr(cli_model.webbrowser, "open", opened.append)
    assert main(["report", str(tmp_path), "--open"]) == 0
    assert capsys.readouterr().out.split() == [new, old]
    assert opened == ["file://" + new]


def test_report_without_one_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "no report.html under" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "is not a folder" in capsys.readouterr().err
