"""The verifiable evaluation's verdict and files: report.html, eval.json, metrics.json and
samples.jsonl.

The gate (``decide``) blesses iff the accuracy gain's lower interval bound is strictly above
``min_accuracy_gain``, and says so in sentences that name the judge and the numbers.

The files are made from the eval record (report.eval_record, built by the stage): eval.json
itself, with the preference evaluation's top-level keys (``blessed``, ``reasons``,
``gate_judge``, ``summary``, the summary JSON-ready: a non-finite figure is None).
metrics.json holds flat figures under plain names (``accuracy``, ``accuracy_gain``,
``pass_at_4``, ``reference_accuracy``, …); samples.jsonl one row per prompt (its text and
columns, each policy's greedy response and whether it is correct). The page reads top-down:
the judge, the verdict and its reasons, the accuracy table of both policies, the reward
functions' means, their training curves, then sample prompts. Every number in a table
carries ``data-key``, its dotted path in the summary (list items by number:
``accuracy_interval.0``); everything from data is escaped. Only process 0 writes.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from components.core import fileio
from components.core.training.distributed import is_primary
from components.core.training.metrics import MetricsLogger, read_metrics
from components.evaluate import plots
from components.evaluate.gate import Gate
from components.evaluate.page import CSS, at, esc, figure, image

# The preference evaluation's file names (report.py, outputs.py: the pipeline reads them),
# restated: importing those modules would stack two more floors on every chain through
# stage.py (tests/test_import_graph.py); a test holds the two sets equal.
REPORT_FILE, EVAL_JSON_FILE = "report.html", "eval.json"
METRICS_JSON_FILE, SAMPLES_FILE = "metrics.json", "samples.jsonl"
YES_NO = {True: "yes", False: "no"}


def decide(summary: Mapping[str, Any], min_accuracy_gain: float) -> Gate:
    """Blessed iff the accuracy gain's lower interval bound > ``min_accuracy_gain``, strictly."""
    judge, gain = summary["judge"], summary["accuracy_gain"]
    low, high = gain["interval"]
    figures = (summary["accuracy"], summary["reference"]["accuracy"], gain["value"], low, high)
    if not all(isinstance(v, float) and math.isfinite(v) for v in figures):
        reason = f"the accuracy figures by {judge} are not all finite numbers {figures}: fail"
        return Gate(False, [reason], judge=judge)
    passed = low > min_accuracy_gain
    reasons = [
        f"accuracy (judged by {judge}, greedy responses, {summary['prompts']} prompts) "
        f"{summary['accuracy']:.4f} against the reference's "
        f"{summary['reference']['accuracy']:.4f}: gain {gain['value']:+.4f}, "
        f"{summary['confidence']:.0%} interval [{low:+.4f}, {high:+.4f}]",
        f"accuracy-gain lower bound {low:+.4f} {'>' if passed else '≤'} min_accuracy_gain "
        f"{min_accuracy_gain:+.4f}: {'pass' if passed else 'fail'}",
    ]
    return Gate(passed, reasons, judge=judge)


def flat_figures(record: Mapping[str, Any]) -> dict[str, float]:
    """The headline figures under plain names (KFP Metrics); None (not finite) drops out."""
    summary = record["summary"]
    flat: dict[str, Any] = {"blessed": 1.0 if record["blessed"] else 0.0}
    for prefix, part in (("", summary), ("reference_", summary.get("reference") or {})):
        flat[f"{prefix}accuracy"] = part.get("accuracy")
        flat[f"{prefix}accuracy_low"], flat[f"{prefix}accuracy_high"] = part["accuracy_interval"]
        for key in ("mean_response_length", "ended_fraction"):
            flat[f"{prefix}{key}"] = part.get(key)
        for k, estimate in (part.get("pass_at_k") or {}).items():
            flat[f"{prefix}pass_at_{k}"] = estimate["value"]
    gain = summary["accuracy_gain"]
    flat["accuracy_gain"] = gain["value"]
    flat["accuracy_gain_low"], flat["accuracy_gain_high"] = gain["interval"]
    flat["kl_per_token"] = at(summary, "kl.per_token")
    for name, means in (summary.get("reward_functions") or {}).items():
        flat[f"rewards/{name}/policy"] = means.get("policy")
        flat[f"rewards/{name}/reference"] = means.get("reference")
    return {name: float(value) for name, value in flat.items() if value is not None}


def _verdict(record: Mapping[str, Any]) -> str:
    blessed = bool(record["blessed"])
    css, title = (
        ("blessed", "Blessed: promote the aligned policy")
        if blessed
        else ("rejected", "Not blessed: keep the current policy")
    )
    reasons = "".join(f"<li>{esc(reason)}</li>" for reason in record["reasons"])
    return (
        f'<div class="verdict {css}" data-blessed="{str(blessed).lower()}" '
        f'data-gate-judge="{esc(record["gate_judge"])}"><h2>{esc(title)}</h2>'
        f"<p>Judged by {esc(record['gate_judge'])}.</p><ul>{reasons}</ul></div>"
    )


def _run_line(summary: Mapping[str, Any]) -> str:
    """The run (run_info.py): its id, the algorithm and step that made the policy, the date."""
    run = summary.get("run") or {}
    facts = (f"run {run.get('id') or '(not in a pipeline run)'}",
             f"{run.get('algorithm', '')} ({run.get('stage', '')} stage, step {run.get('step')})",
             f"evaluated {run.get('evaluated', '')}")  # fmt: skip
    return f'<p class="run">{esc(" · ".join(facts))}</p>' if run else ""


def _judge(summary: Mapping[str, Any]) -> str:
    spec = at(summary, "verifier.spec") or ""
    text = (
        f"Judge: {summary.get('judge')} ({spec}). A response is correct when it gets full marks "
        f"(a reward >= {at(summary, 'verifier.full_marks')}); accuracy is the share of prompts "
        "whose greedy response is correct, pass@k the chance that one of k samples at "
        f"temperature {at(summary, 'temperature')} is (Chen et al.'s unbiased estimator)."
    )
    return f'<p class="judge" data-judge="{esc(summary.get("judge"))}">{esc(text)}</p>'


def _estimate_cells(summary: Mapping[str, Any], value: str, interval: str) -> str:
    low, high = figure(summary, f"{interval}.0", "span"), figure(summary, f"{interval}.1", "span")
    return f'{figure(summary, value)}<td class="num">[{low}, {high}]</td>'


def _accuracy_table(summary: Mapping[str, Any]) -> str:
    """Accuracy (with interval), pass@k, mean length and stop share of both policies."""
    rows = [("accuracy (greedy)", "accuracy", "accuracy_interval")]
    rows += [
        (f"pass@{k}", f"pass_at_k.{k}.value", f"pass_at_k.{k}.interval")
        for k in (summary.get("pass_at_k") or {})
    ]
    body = [
        f"<tr><th>{esc(label)}</th>{_estimate_cells(summary, value, interval)}"
        f"{_estimate_cells(summary, f'reference.{value}', f'reference.{interval}')}</tr>"
        for label, value, interval in rows
    ]
    for label, key in (
        ("mean response length (tokens, stop included)", "mean_response_length"),
        ("ended with a stop token", "ended_fraction"),
    ):
        body.append(
            f"<tr><th>{esc(label)}</th>{figure(summary, key)}<td></td>"
            f"{figure(summary, f'reference.{key}')}<td></td></tr>"
        )
    level = f"{summary.get('confidence', 0.95):.0%}"
    return (
        f"<h2>Accuracy</h2><p>{figure(summary, 'prompts', 'span')} eval prompts, "
        f"{figure(summary, 'samples_per_prompt', 'span')} sample(s) each for pass@k; "
        f"{esc(level)} percentile-bootstrap intervals over prompts.</p>"
        f'<table class="accuracy"><tr><th>measure</th><th>policy</th><th>{esc(level)} '
        f"interval</th><th>reference</th><th>{esc(level)} interval</th></tr>{''.join(body)}"
        f"<tr><th>accuracy gain (policy − reference, paired)</th>"
        f"{_estimate_cells(summary, 'accuracy_gain.value', 'accuracy_gain.interval')}"
        f"<td></td><td></td></tr></table>"
    )


def _functions_table(summary: Mapping[str, Any]) -> str:
    """Each reward function's mean on both policies' greedy responses, and the KL."""
    body = "".join(
        f"<tr><th>{esc(name)}</th><td>{esc(means.get('spec'))}</td>"
        f"{figure(summary, f'reward_functions.{name}.weight')}"
        f"{figure(summary, f'reward_functions.{name}.policy')}"
        f"{figure(summary, f'reward_functions.{name}.reference')}</tr>"
        for name, means in (summary.get("reward_functions") or {}).items()
    )
    return (
        "<h2>Reward functions</h2><p>Mean reward on the greedy responses, over those each "
        f"function judged. KL(policy ‖ reference) {figure(summary, 'kl.per_token', 'span')} "
        f"nats per token ({esc(at(summary, 'kl.estimator'))}).</p><table><tr><th>function</th>"
        f"<th>spec</th><th>weight</th><th>policy</th><th>reference</th></tr>{body}</table>"
    )


def _samples(rows: Sequence[Mapping[str, Any]], num: int, seed: int) -> str:
    """``num`` prompts drawn at random (typical, not the best or worst), in prompt order."""
    chosen = np.sort(np.random.default_rng(seed).permutation(len(rows))[: max(num, 0)])
    if not len(chosen):
        return '<h2>Samples</h2><p class="missing">no samples shown</p>'
    head = ("#", "prompt", "columns", "policy response", "correct", "reference response",
            "correct")  # fmt: skip
    body = []
    for i in chosen.tolist():
        row = rows[i]
        cells = (row["prompt_index"], row["prompt"], json.dumps(row["columns"]),
                 row["policy_response"], YES_NO[row["policy_correct"]],
                 row["reference_response"], YES_NO[row["reference_correct"]])  # fmt: skip
        body.append("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in cells) + "</tr>")
    header = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f"<h2>Samples</h2><table><tr>{header}</tr>{''.join(body)}</table>"


def render_report(
    record: Mapping[str, Any],
    *,
    training_metrics: Sequence[Mapping[str, Any]] = (),
    rows: Sequence[Mapping[str, Any]] = (),
    num_samples: int = 20,
    seed: int = 0,
) -> str:
    """The whole report as one self-contained HTML page (verdict first)."""
    shown = record["summary"]  # the page shows exactly what eval.json holds
    curves = image(
        plots.reward_function_curves(training_metrics, verifier=at(shown, "verifier.name")),
        "each reward function's mean per rollout while the policy trained",
        "no reward-function metrics in the policy's training log (not trained with them)",
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>alignpipe evaluation</title><style>{CSS}</style></head><body>"
        f"<h1>alignpipe evaluation: verifiable task</h1>{_run_line(shown)}{_judge(shown)}"
        f"{_verdict(record)}{_accuracy_table(shown)}{_functions_table(shown)}<h2>Training</h2>{curves}"
        f"{_samples(rows, num_samples, seed)}</body></html>\n"
    )


def write_outputs(
    output: str,
    record: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    policy_dir: str,
    config: Any = None,
) -> None:
    """report.html, eval.json (``record``), metrics.json and samples.jsonl (``rows``, plain
    JSON values) into ``output``, process 0 only; the flat figures also go to the trackers
    ``config.report_to`` names (``eval/<figure>``, as outputs.report_figures names them)."""
    if not is_primary():
        return
    fileio.makedirs(output)
    page = render_report(
        record, training_metrics=read_metrics(policy_dir), rows=rows,
        num_samples=getattr(config, "num_report_samples", 20), seed=getattr(config, "seed", 0),
    )  # fmt: skip
    fileio.write_text(fileio.join(output, REPORT_FILE), page)
    text = json.dumps(record, indent=2, allow_nan=False, ensure_ascii=False) + "\n"
    fileio.write_text(fileio.join(output, EVAL_JSON_FILE), text)
    flat = flat_figures(record)
    text = json.dumps(flat, indent=2, sort_keys=True) + "\n"
    fileio.write_text(fileio.join(output, METRICS_JSON_FILE), text)
    lines = [json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows]
    fileio.write_text(fileio.join(output, SAMPLES_FILE), "".join(lines))
    if config is not None:
        with MetricsLogger(output, total_steps=1, stage="evaluate", stream=io.StringIO(),
                           config=config) as logger:  # fmt: skip
            logger.log(1, {f"eval/{name}": value for name, value in flat.items()})


def sample_rows(
    prompt_texts: Sequence[str],
    columns: Sequence[Mapping[str, Any]],
    responses: Mapping[str, Sequence[str]],
    arrays: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """samples.jsonl's rows, one per prompt: its text and columns, then for each policy
    (``responses``' keys) its greedy response, whether it is correct and how many of its
    samples are (None without samples), from ``verifiable_summary``'s ``arrays``."""
    rows = []
    for p, (text, record) in enumerate(zip(prompt_texts, columns, strict=True)):
        row: dict[str, Any] = {"prompt_index": p, "prompt": text, "columns": dict(record)}
        for role, texts in responses.items():
            sampled = arrays[role]["sampled_correct"]
            row[f"{role}_response"] = texts[p]
            row[f"{role}_correct"] = bool(arrays[role]["greedy_correct"][p])
            row[f"{role}_samples_correct"] = None if sampled is None else int(sampled[p].sum())
        rows.append(row)
    return rows
