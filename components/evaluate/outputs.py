"""The evaluate stage's files: report.html and eval.json (report.py), metrics.json, samples.jsonl.

``samples.jsonl`` holds one line per eval sample, (prompt, sample index) in row order: the
prompt, the aligned and the reference response, their judge's scores (the reward model's,
or the gold ones when the gold reward judges) and their gold scores (null when no gold
reward is known). Only process 0 writes.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from components.core import fileio
from components.core.training.distributed import is_primary
from components.core.training.metrics import MetricsLogger, read_events, read_metrics
from components.evaluate.gate import Gate
from components.evaluate.measures import JUDGE_GOLD
from components.evaluate.report import json_ready, write_report

METRICS_JSON_FILE = "metrics.json"
SAMPLES_FILE = "samples.jsonl"


def flat_figures(summary: dict[str, Any], gate: Gate) -> dict[str, float]:
    """Every finite figure of the summary by dotted path (KFP Metrics), plus blessed as 0/1.

    A best-of-n point is named by its n: ``best_of_n.n4.gold``. Strings (the gold reward's
    name) are not figures and drop out, except the judge: ``judge_is_gold`` is 1 when the
    gold reward judged (no reward model), else 0.
    """
    flat: dict[str, float] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else key)
        elif isinstance(node, list):
            for point in node:
                if isinstance(point, dict) and "n" in point:
                    walk({k: v for k, v in point.items() if k != "n"}, f"{path}.n{point['n']}")
        elif isinstance(node, int | float) and not isinstance(node, bool):
            flat[path] = float(node)

    # Histogram counts are a plot's data, not figures; the run's facts (its step, its
    # settings) describe it, not its evaluation; None (not measured, non-finite) drops out.
    skip = ("reward_histogram", "schema_version", "best_of_n_curve", "run")
    walk({k: v for k, v in json_ready(summary).items() if k not in skip}, "")
    flat["blessed"] = 1.0 if gate.blessed else 0.0
    flat["judge_is_gold"] = 1.0 if summary.get("judge") == JUDGE_GOLD else 0.0
    return flat


def sample_rows(
    prompt_texts: Sequence[str],
    aligned: tuple[Sequence[str], np.ndarray, np.ndarray | None],
    reference: tuple[Sequence[str], np.ndarray, np.ndarray | None],
) -> list[dict[str, Any]]:
    """One row per (prompt, sample): each policy given as (texts [P * S], rewards, gold [P, S])."""
    rows = []
    prompts, samples = aligned[1].shape
    for p in range(prompts):
        for s in range(samples):
            row: dict[str, Any] = {"prompt_index": p, "sample": s, "prompt": prompt_texts[p]}
            for name, (texts, rewards, gold) in (("aligned", aligned), ("reference", reference)):
                row[f"{name}_response"] = texts[p * samples + s]
                row[f"{name}_reward"] = float(rewards[p, s])
                row[f"{name}_gold"] = None if gold is None else float(gold[p, s])
            rows.append(row)
    return rows


def write_samples(output: str, rows: Sequence[dict[str, Any]]) -> str:
    """``samples.jsonl`` in ``output``, one JSON object a line; returns its path."""
    path = fileio.join(output, SAMPLES_FILE)
    lines = [json.dumps(json_ready(row), ensure_ascii=False, allow_nan=False) for row in rows]
    fileio.write_text(path, "".join(line + "\n" for line in lines))
    return path


def write_outputs(
    output: str,
    summary: dict[str, Any],
    gate: Gate,
    *,
    dirs: dict[str, str],
    samples: list[dict[str, Any]],
    all_samples: Sequence[dict[str, Any]] = (),
    config: Any = None,
) -> None:
    """report.html, eval.json, metrics.json and samples.jsonl into ``output`` (process 0 only);
    the figures also go to the trackers ``config.report_to`` names (``eval/…``).

    ``dirs`` holds the models' folders by role; "reward" is absent when the gold reward judged.
    """
    if not is_primary():
        return
    # PPO's guard restorations travel with its metrics: the curves mark them as events.
    ppo_rows = read_metrics(dirs["policy"]) + read_events(dirs["policy"])
    reward_rows = read_metrics(dirs["reward"]) if "reward" in dirs else []
    write_report(
        output, summary, gate, ppo_metrics=ppo_rows or None,
        reward_metrics=reward_rows or None, samples=samples,
    )  # fmt: skip
    flat = flat_figures(summary, gate)
    fileio.write_text(
        fileio.join(output, METRICS_JSON_FILE), json.dumps(flat, indent=2, sort_keys=True) + "\n"
    )
    if config is not None:
        report_figures(output, flat, config)
    write_samples(output, all_samples)


def report_figures(output: str, figures: dict[str, float], config: Any) -> None:
    """The evaluation's figures to its trackers (TensorBoard under ``output``, W&B, MLflow,
    Vertex): one step, named ``eval/<figure>`` with ``/`` for the summary's dots
    (``eval/win_rate``, ``eval/best_of_n/n4/gold``)."""
    named = {"eval/" + name.replace(".", "/"): value for name, value in figures.items()}
    with MetricsLogger(
        output, total_steps=1, stage="evaluate", stream=io.StringIO(), config=config
    ) as logger:
        logger.log(1, named)
