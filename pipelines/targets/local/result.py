"""What a local run leaves (``RunResult``: where, how each stage went, its figures) and its
end-of-run summary: each stage's status and time, then the figures (or the failure, or
"no new data")."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from pipelines import stage_io
from pipelines.dag import params
from pipelines.dag.stages import RESULT, STAGE_TASKS
from pipelines.releases.realign import NO_NEW_DATA

# Who judged the evaluation's win rate (eval.json's summary.judge), in words.
_JUDGES = {"reward_model": "reward model", "gold": "gold reward"}
TASK_STAGE = {task: stage for stage, tasks in STAGE_TASKS.items() for task in tasks}


@dataclasses.dataclass(slots=True)
class StageRecord:
    """One stage of a local run: ran, cached, skipped or failed, and for how long."""

    stage: str
    status: str = "skipped"
    seconds: float | None = None
    started: float | None = None
    task: str = ""  # the task that stood for the stage (sft's is given-policy on warm starts)


@dataclasses.dataclass(slots=True)
class RunResult:
    """What a local run leaves: where, how each stage went, and the figures of the summary."""

    run_dir: Path | None
    stages: dict[str, StageRecord]
    executed: set[str]
    outputs: dict[str, Any]
    seconds: float
    values: dict[str, Any]
    error: str = ""
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)  # failed task → why
    log: Path | None = None  # everything kfp.local and the tasks printed (run_log.py)

    def result(self) -> dict[str, Any]:
        """The run's result output: evaluated (with its files), or no new data."""
        return json.loads(self.outputs.get(RESULT) or "{}")

    def figures(self) -> dict[str, Any]:
        """The summary's figures from the stages' metrics files (missing ones are None)."""
        result = self.result()
        aligned = stage_io.reference_details(result.get("aligned") or "")
        trained = aligned.get("figures", {})
        evaluation = _metrics(result.get("metrics"))
        eval_folder = result.get("evaluation")
        record = _eval_record(eval_folder)
        return {
            "status": result.get("status"),
            "algorithm": aligned.get("algorithm"),
            "reward_accuracy": trained.get("reward_accuracy"),
            "ppo_stopped": trained.get("stopped_kl_guard"),
            "ppo_restores": trained.get("restores"),
            "dpo_steps": trained.get("steps"),
            "dpo_accuracy": trained.get("accuracy"),
            "judge": _JUDGES.get(record.get("summary", {}).get("judge"), "n/a"),
            "win_rate": evaluation.get("win_rate/value"),
            "win_rate_low": evaluation.get("win_rate/low"),
            "win_rate_high": evaluation.get("win_rate/high"),
            "gold_win_rate": evaluation.get("gold/win_rate/value"),
            "gold_win_rate_low": evaluation.get("gold/win_rate/low"),
            "gold_win_rate_high": evaluation.get("gold/win_rate/high"),
            "gold_outcomes": [evaluation.get(f"gold/win_rate/{n}") for n in _OUTCOMES],
            "ppo_vs_best_of_n": evaluation.get("ppo_vs_best_of_n"),
            "ppo_vs_best_of_n_bound": evaluation.get("ppo_vs_best_of_n_bound"),
            "ppo_vs_best_of_n_chord": evaluation.get("ppo_vs_best_of_n_chord"),
            "ppo_vs_best_of_n_low": evaluation.get("ppo_vs_best_of_n_interval/low"),
            "ppo_vs_best_of_n_high": evaluation.get("ppo_vs_best_of_n_interval/high"),
            "gold_win_rate_coupled": evaluation.get("gold/win_rate/coupled/value"),
            "gate_judge": record.get("gate_judge"),
            "gold_gain": evaluation.get("gold/difference/value"),
            "gold_gain_low": evaluation.get("gold/difference/low"),
            "gold_gain_high": evaluation.get("gold/difference/high"),
            "kl_per_token": evaluation.get("kl/per_token"),
            "anchor_kl_per_token": evaluation.get("anchor/kl/per_token"),
            "anchor_win_rate": evaluation.get("anchor/win_rate/value"),
            "anchor_is_reference": evaluation.get("anchor/same_as_reference"),
            "blessed": evaluation.get("blessed"),
            **_verifiable_figures(record.get("summary", {})),
            "gate": list(record.get("reasons", [])),
            # The evaluation folder's copy ends in .html, so a browser opens it as a page.
            "report": str(Path(eval_folder) / "report.html") if eval_folder else None,
        }


_OUTCOMES = ("wins", "ties", "losses")


def _verifiable_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """A verifiable evaluation's figures (evaluate/verifiable_stage.py), from eval.json."""
    if summary.get("kind") != "verifiable":
        return {"verifiable": False}
    gain = summary["accuracy_gain"]
    return {
        "verifiable": True,
        "accuracy": summary["accuracy"],
        "reference_accuracy": summary["reference"]["accuracy"],
        "accuracy_gain": gain["value"],
        "accuracy_gain_low": gain["interval"][0],
        "accuracy_gain_high": gain["interval"][1],
        "pass_at_k": {k: v["value"] for k, v in summary.get("pass_at_k", {}).items()},
        "verifier": summary["judge"],
    }


def _independent_judge(figures: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """A note when the gate's win rate was the reward model's the policy was trained
    against: it rewards exploiting that model as much as improving."""
    if figures.get("gate_judge") != "reward_model" or values.get("eval_reward_model"):
        return []
    return [
        "  note: no gold reward, so the gate judged by the reward model the policy was "
        "trained against; pass --gold-reward (PATH.py:FUNCTION) or --eval-reward-model (a "
        "reward model trained apart) to judge it independently"
    ]


def _eval_record(folder: str | None) -> dict[str, Any]:
    """The evaluate stage's eval.json (summary, the gate's reasons), or {} when absent."""
    path = Path(folder) / "eval.json" if folder else None
    if path is None or not path.exists():
        return {}
    return json.loads(path.read_text())


def _metrics(path: str | None) -> dict[str, float]:
    """The scalar metrics a component wrote to its Metrics artifact file (a local run's)."""
    if not path or not os.path.exists(path):
        return {}
    return json.loads(Path(path).read_text())["metrics"]


def format_summary(result: RunResult) -> str:
    """The end-of-run summary: each stage's status and time, then the figures."""
    lines = [f"alignpipe run: {result.run_dir or '(every task from the cache)'}"]
    lines.append(f"{'stage':<10} {'status':<8} {'time':>8}  task")
    for record in result.stages.values():
        took = f"{record.seconds:.1f} s" if record.seconds is not None else "-"
        lines.append(f"{record.stage:<10} {record.status:<8} {took:>8}  {record.task}".rstrip())
    lines.append(f"total {result.seconds:.0f} s")
    if result.error:
        return "\n".join([*lines, *_failure(result)])
    f = result.figures()
    if f["status"] == NO_NEW_DATA:
        return "\n".join([*lines, _no_new_data(result.result()), f"log: {result.log}"])
    lines += [
        f"initial policy         {initial_policy(result.values)}",
        f"reward-model accuracy  {_num(f['reward_accuracy'])}",
        f"{f['algorithm'] or 'aligned':<22} {_training_status(f)}",
        *(_verifiable(f) if f["verifiable"] else _preference(f)),
        f"blessed                {_blessed(f['blessed'])}",
        *(f"  gate: {reason}" for reason in f["gate"]),
        *_independent_judge(f, result.values),
        f"report                 {f['report']}",
        f"log                    {result.log}",
    ]
    return "\n".join(lines)


def _verifiable(f: dict[str, Any]) -> list[str]:
    """A verifiable evaluation's lines: accuracy before and after, the gain, pass@k."""
    passes = ", ".join(f"pass@{k} {_num(v)}" for k, v in f["pass_at_k"].items())
    return [
        f"accuracy               {_num(f['reference_accuracy'])} -> {_num(f['accuracy'])} "
        f"(greedy, held-out prompts; judged by the {f['verifier']})",
        f"accuracy gain          {_interval(f, 'accuracy_gain', signed=True)}",
        f"pass@k                 {passes or 'n/a'}",
        f"KL per token           {_general(f['kl_per_token'])} nats",
    ]


def _preference(f: dict[str, Any]) -> list[str]:
    """A preference evaluation's lines: win rates, gold gain, best-of-n, KL."""
    return [
        f"win rate vs reference  {_interval(f, 'win_rate')} (judged by the {f['judge']})",
        f"gold win rate          {_interval(f, 'gold_win_rate')}{_outcomes(f['gold_outcomes'])}"
        f" (independent pairs; {_num(f['gold_win_rate_coupled'])} paired by sampling key)",
        f"gold-reward gain       {_interval(f, 'gold_gain', signed=True)}",
        # The aligned policy's gold gain over best-of-n's at the same KL (> 1: it spends its
        # KL better than sampling n and keeping the judge's best).
        f"vs best-of-n           {_interval(f, 'ppo_vs_best_of_n')} (gold gain / best-of-n's "
        f"at the same KL on its any-n curve; {_num(f['ppo_vs_best_of_n_chord'])} on the chord, "
        f"{_num(f['ppo_vs_best_of_n_bound'])} on the bound)",
        # General format: a small KL stays visible instead of rounding to 0.000.
        f"KL per token           {_general(f['kl_per_token'])} nats",
        f"KL to the anchor       {_general(f['anchor_kl_per_token'])} nats/token"
        + (" (the anchor is the reference)" if f["anchor_is_reference"] else ""),
    ]


def initial_policy(values: dict[str, Any]) -> str:
    """Where the run's initial policy came from, in words (the parameters decide it)."""
    base = values.get("base_policy", "")
    if not base:
        return f"sft from a fresh {values.get('preset') or params.defaults()['preset']} model"
    if values.get("sft_on_base"):
        return f"sft on {base}"
    return f"{base}, as given (no sft)"


def _failure(result: RunResult) -> list[str]:
    """The summary's end for a failed run: which task failed, the log, then each failed
    task's own error (last, where the eye lands), else kfp.local's message."""
    tasks = ", ".join(f"{task} ({TASK_STAGE[task]})" for task in result.reasons)
    lines = [f"log: {result.log}", f"FAILED: {tasks or result.error}"]
    for task, reason in result.reasons.items():
        lines.append(f"  {task}: " + reason.replace("\n", "\n    "))
    return lines


def _no_new_data(result: dict[str, Any]) -> str:
    """The summary's line for a run that trained nothing."""
    matched = result.get("matches_version")
    where = f" (those of version {matched}, run {result.get('matches_run') or '?'})"
    return (
        f"{NO_NEW_DATA}: nothing trained; the {result.get('files')} data file(s) equal the last "
        f"promoted run's{where if matched else ''}; force_run=true trains anyway"
    )


def _training_status(f: dict[str, Any]) -> str:
    """How the aligning stage ended: dpo's steps, or whether the RL stage's KL guard stopped it."""
    if f["algorithm"] == "dpo":
        return (
            f"{int(f['dpo_steps'] or 0)} steps, eval preference accuracy {_num(f['dpo_accuracy'])}"
        )
    if f["ppo_stopped"] is None:
        return "n/a"
    restores = int(f["ppo_restores"] or 0)
    if f["ppo_stopped"]:
        return f"stopped by the KL guard after {restores} restorations (last good policy kept)"
    return f"completed ({restores} KL-guard restorations)"


def _num(value: float | None, signed: bool = False) -> str:
    """A figure with three decimals, or n/a."""
    if value is None:
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _general(value: float | None) -> str:
    """A figure with three significant digits, or n/a."""
    return "n/a" if value is None else f"{value:.3g}"


def _interval(f: dict[str, Any], key: str, signed: bool = False) -> str:
    """A figure with its bootstrap interval when there is one."""
    low, high = f.get(f"{key}_low"), f.get(f"{key}_high")
    bounds = f" [{_num(low, signed)}, {_num(high, signed)}]" if low is not None else ""
    return _num(f[key], signed) + bounds


def _outcomes(counts: list[float | None]) -> str:
    """The independent pairs behind a win rate (each aligned sample against each reference
    draw of its prompt but the one of the same key): ties count half."""
    if any(count is None for count in counts):
        return ""
    return " (" + ", ".join(f"{int(c)} {n}" for c, n in zip(counts, _OUTCOMES, strict=True)) + ")"


def _blessed(value: float | None) -> str:
    """The promotion gate's verdict in words."""
    if value is None:
        return "n/a"
    return "yes (promoted)" if value else "no (not promoted)"
