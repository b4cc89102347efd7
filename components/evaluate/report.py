"""The evaluation report: one self-contained HTML file, and eval.json holding the same figures.

The page reads top-down: who judged the responses (the reward model, or the gold reward when
no reward model was given), the gate's verdict and its reasons, the figures (head-to-head, per
policy, then the best-of-n baseline with the aligned policy's gain as a share of its gain at
the same KL), the plots (inline base64 PNG, the KL frontier among them), then samples. Every
number in a table cell carries ``data-key`` with its dotted path in the summary (list items
by number: ``best_of_n.0.gold``), so a reader (or a test) can match the page against
eval.json. Everything that comes from data, including the gate's
reasons, passes through ``html.escape``; the page has no scripts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from components.core import fileio
from components.evaluate import plots
from components.evaluate.anchor import render_drift
from components.evaluate.best_of_n_section import best_of_n_section, frontier_plot
from components.evaluate.gate import Gate
from components.evaluate.measures import JUDGE_GOLD, JUDGE_REWARD_MODEL
from components.evaluate.overoptimisation_report import overoptimisation_section
from components.evaluate.page import (  # noqa: F401 (format_figure: the report's API)
    CSS,
    at,
    esc,
    figure,
    format_figure,
    image,
    interval_cells,
    is_gold_judged,
    judge_name,
)

EVAL_JSON_SCHEMA_VERSION = 1
REPORT_FILE = "report.html"
EVAL_JSON_FILE = "eval.json"


class ReportPaths(NamedTuple):
    """Where ``write_report`` put its files."""

    report: str
    eval_json: str


def json_ready(tree: Any) -> Any:
    """``tree`` with NumPy scalars made plain and non-finite floats made None (valid JSON)."""
    if isinstance(tree, Mapping):
        return {str(key): json_ready(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return [json_ready(value) for value in tree]
    if isinstance(tree, np.generic):
        tree = tree.item()
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def _judge(summary: Mapping[str, Any]) -> str:
    """The header's line on who scored the responses: the win rate, rewards and best-of-n."""
    if is_gold_judged(summary):
        text = (
            f"Judge: the gold reward {judge_name(summary)}; no reward model was given. The win "
            "rate, the rewards and the best-of-n selection are by the gold reward (best-of-n is "
            "then the oracle baseline), and no reward model's accuracy is measured."
        )
    else:
        gate = (
            f"the gold reward {at(summary, 'gold.name') or ''}".rstrip()
            if at(summary, "gate_judge") == JUDGE_GOLD
            else "the reward model (no gold reward is known)"
        )
        text = (
            "Win rate judged by the reward model: the win rate, the rewards and the best-of-n "
            "selection are by its scores; gold figures, where shown, by the gold reward. "
            f"Gate's win-rate rule judged by {gate}."
        )
    judge = at(summary, "judge") or JUDGE_REWARD_MODEL
    gate_judge = at(summary, "gate_judge") or judge
    return (
        f'<p class="judge" data-judge="{esc(judge)}" data-gate-judge="{esc(gate_judge)}">'
        f"{esc(text)}</p>"
    )


def _run_header(summary: Mapping[str, Any]) -> str:
    """The run: its id, the date, the algorithm and the model it aligned, the gate's judge,
    the key hyperparameters (run_info.py)."""
    run = at(summary, "run")
    if not isinstance(run, Mapping):
        return ""
    gate_judge = at(summary, "gate_judge") or at(summary, "judge") or JUDGE_REWARD_MODEL
    judged = (
        f"the gold reward {at(summary, 'gold.name') or judge_name(summary)}".rstrip()
        if gate_judge == JUDGE_GOLD
        else "the reward model"
    )
    facts = [
        f"run {run.get('id') or '(not in a pipeline run)'}",
        f"evaluated {run.get('evaluated', '')}",
        f"{run.get('algorithm', '')} ({run.get('stage', '')} stage, step {run.get('step')})",
        f"aligned from {run.get('base_model') or 'a fresh model'}",
        f"gate judged by {judged}",
    ]
    settings = ", ".join(f"{k} {v}" for k, v in (run.get("hyperparameters") or {}).items())
    return (
        f'<p class="run" data-run-id="{esc(str(run.get("id", "")))}">'
        f"{esc(' · '.join(facts))}</p>"
        + (f'<p class="run-settings">{esc(settings)}</p>' if settings else "")
    )


def _verdict(gate: Gate) -> str:
    """The verdict and its reasons, first on the page."""
    css, title = (
        ("blessed", "Blessed: promote the aligned policy")
        if gate.blessed
        else ("rejected", "Not blessed: keep the current policy")
    )
    reasons = "".join(f"<li>{esc(reason)}</li>" for reason in gate.reasons)
    blessed = "true" if gate.blessed else "false"
    decider = (
        "The gold reward decided the win-rate rule."
        if gate.judge == JUDGE_GOLD
        else "The reward model decided the win-rate rule: with no gold reward, nothing "
        "independent of what the policy was trained against judged it."
    )
    return (
        f'<div class="verdict {css}" data-blessed="{blessed}" data-gate-judge="{gate.judge}">'
        f"<h2>{esc(title)}</h2><p>{esc(decider)}</p><ul>{reasons}</ul></div>"
    )


def _head_to_head_rows(summary: Mapping[str, Any]) -> list[tuple[str, str, str | None]]:
    """(label, value path, interval path) of each head-to-head row; gold rows unless gold
    judged (they would repeat the judge's)."""
    gold_judged = is_gold_judged(summary)
    score = judge_name(summary) if gold_judged else "reward"
    rows = [
        (f"win rate ({judge_name(summary)})", "win_rate.value", "win_rate"),
        (
            f"length-controlled win rate ({judge_name(summary)})",
            "lc_win_rate.value",
            "lc_win_rate",
        ),
        (
            f"mean {score} difference (aligned − reference)",
            "reward.difference.value",
            "reward.difference",
        ),
        ("KL(aligned ‖ reference), nats per token", "kl.per_token", None),
        ("KL(aligned ‖ reference), nats per sequence", "kl.per_sequence", None),
        ("reward-model accuracy on held-out pairs", "reward_model_accuracy.value", None),
    ]
    if at(summary, "gold") is not None and not gold_judged:
        name = at(summary, "gold.name") or "gold"
        rows += [
            (f"win rate ({name})", "gold.win_rate.value", "gold.win_rate"),
            (
                f"length-controlled win rate ({name})",
                "gold.lc_win_rate.value",
                "gold.lc_win_rate",
            ),
            (
                f"mean {name} difference (aligned − reference)",
                "gold.difference.value",
                "gold.difference",
            ),
        ]
    return rows


def _head_to_head(summary: Mapping[str, Any]) -> str:
    """Figures that compare the two policies, with their bootstrap intervals."""
    confidence = at(summary, "confidence")
    level = f"{confidence:.0%}" if isinstance(confidence, float) else "?"
    gold_judged = is_gold_judged(summary)
    body = []
    for label, value_path, interval_path in _head_to_head_rows(summary):
        part = value_path.split(".")[0]
        # A part left out is None (at its top key, or the figure's own: gold's LC win rate);
        # a NaN figure inside one shows as n/a.
        if at(summary, part) is None or at(summary, value_path.rpartition(".")[0]) is None:
            why = "no reward model" if gold_judged and part == "reward_model_accuracy" else ""
            cells = f'<td class="num missing">{why or "not measured"}</td><td></td>'
        else:
            interval = interval_cells(summary, interval_path) if interval_path else "<td></td>"
            cells = figure(summary, value_path) + interval
        body.append(f"<tr><th>{esc(label)}</th>{cells}</tr>")
    counts = " ".join(
        f"{figure(summary, f'win_rate.{key}', 'span')} {key}" for key in ("wins", "ties", "losses")
    )
    verdicts = "Gold-reward verdicts" if gold_judged else "Reward-model verdicts"
    return (
        f"<h2>Aligned against reference</h2><p>{figure(summary, 'num_prompts', 'span')} "
        f"prompts, {figure(summary, 'samples_per_prompt', 'span')} sample(s) each; "
        f"{esc(level)} percentile-bootstrap intervals over prompts. Win rates compare each "
        "aligned sample with each reference draw of its prompt that was not drawn with the "
        "same key (independent pairs: the same key makes both responses identical wherever "
        f"the policies agree). {verdicts} over those pairs: {counts}.{_coupled(summary)}"
        f"{_length_control(summary)}</p>"
        f"<table><tr><th>measure</th><th>value</th><th>{esc(level)} interval</th>"
        f"</tr>{''.join(body)}</table>"
    )


def _length_control(summary: Mapping[str, Any]) -> str:
    """A sentence on the length-controlled win rate: the model fitted, the length term."""
    if at(summary, "lc_win_rate") is None:
        return ""
    return (
        " The length-controlled win rate is the win rate at equal response lengths "
        f"(AlpacaEval 2's idea; {esc(at(summary, 'lc_win_rate.model'))}), fitted on the "
        "aligned and reference samples' independent pairs: length coefficient b1 "
        f"{figure(summary, 'lc_win_rate.length_coefficient', 'span')}, mean length "
        f"difference {figure(summary, 'lc_win_rate.mean_length_difference', 'span')} tokens."
    )


def _coupled(summary: Mapping[str, Any]) -> str:
    """A sentence with the same-key pairing's win rate and ties, when it was measured."""
    if at(summary, "win_rate.coupled") is None:
        return ""
    return (
        f" Paired sample s with sample s (same key) it would read "
        f"{figure(summary, 'win_rate.coupled.value', 'span')}, with "
        f"{figure(summary, 'win_rate.coupled.ties', 'span')} ties of "
        f"{figure(summary, 'win_rate.coupled.pairs', 'span')}: not the win rate of two "
        "policies' independent responses."
    )


def _per_policy(summary: Mapping[str, Any]) -> str:
    """Figures of each policy side by side (no gold rows when gold judged: they would repeat)."""
    score = judge_name(summary) if is_gold_judged(summary) else "reward"
    rows = [
        (f"mean {score}", "reward.{}.mean"),
        (f"median {score}", "reward.{}.median"),
        ("mean response length (tokens, EOS included)", "response_length.{}.mean"),
        ("median response length", "response_length.{}.median"),
        ("EOS rate (stopped before max_new_tokens)", "eos_rate.{}"),
    ]
    if at(summary, "gold") is not None and not is_gold_judged(summary):
        name = at(summary, "gold.name") or "gold"
        rows += [(f"mean {name}", "gold.{}.mean"), (f"median {name}", "gold.{}.median")]
    body = "".join(
        f"<tr><th>{esc(label)}</th>{figure(summary, path.format('aligned'))}"
        f"{figure(summary, path.format('reference'))}</tr>"
        for label, path in rows
    )
    return (
        "<h2>Each policy</h2><table><tr><th>measure</th><th>aligned</th><th>reference</th></tr>"
        f"{body}</table>"
    )


def _plots(
    summary: Mapping[str, Any],
    ppo_metrics: Sequence[Mapping[str, Any]] | None,
    reward_metrics: Sequence[Mapping[str, Any]] | None,
) -> str:
    """Every plot whose data is present; a short note for each that is not."""
    judge, gold_judged = judge_name(summary), is_gold_judged(summary)
    estimates = {judge: at(summary, "win_rate") or {}}
    if at(summary, "gold") is not None and not gold_judged:
        estimates[at(summary, "gold.name") or "gold"] = at(summary, "gold.win_rate") or {}
    confidence = at(summary, "confidence") or 0.95
    score, axis, no_curves = (
        (judge, judge, "no reward model (the gold reward judged)")
        if gold_judged
        else ("reward", "reward-model reward", "no reward-model metrics given")
    )
    parts = [
        image(plots.win_rates(estimates, confidence), "win rate with interval", "no win rate plot"),
        image(
            plots.reward_distributions(at(summary, "reward_histogram"), axis),
            f"per-prompt {score} distributions",
            "no rewards to plot",
        ),
        frontier_plot(summary),
        image(
            plots.ppo_curves(ppo_metrics),
            "PPO training curves (ppo, grpo or rloo)",
            "no PPO metrics given (the policy was not trained by the ppo stage: dpo or sft)",
        ),
        image(plots.reward_model_curves(reward_metrics), "reward-model training curves", no_curves),
    ]
    return "<h2>Plots</h2>" + "".join(parts)


def _reward_cell(value: Any) -> str:
    number = (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    )
    return f'<td class="num">{esc(format_figure(number))}</td>'


def _samples(samples: Sequence[Mapping[str, Any]]) -> str:
    """Prompts with both responses and their rewards."""
    if not samples:
        return '<h2>Samples</h2><p class="missing">no samples given</p>'
    has_gold = any("aligned_gold" in s or "reference_gold" in s for s in samples)
    head = ["#", "prompt", "aligned response", "reward", "reference response", "reward"]
    if has_gold:
        head += ["aligned gold", "reference gold"]
    rows = []
    for number, sample in enumerate(samples, start=1):
        cells = [
            f'<td class="num">{number}</td>',
            f'<td class="text">{esc(sample.get("prompt", ""))}</td>',
            f'<td class="text">{esc(sample.get("aligned_response", ""))}</td>',
            _reward_cell(sample.get("aligned_reward")),
            f'<td class="text">{esc(sample.get("reference_response", ""))}</td>',
            _reward_cell(sample.get("reference_reward")),
        ]
        if has_gold:
            cells += [
                _reward_cell(sample.get("aligned_gold")),
                _reward_cell(sample.get("reference_gold")),
            ]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    header = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f"<h2>Samples</h2><table><tr>{header}</tr>{''.join(rows)}</table>"


def render_report(
    summary: Mapping[str, Any],
    gate: Gate,
    *,
    ppo_metrics: Sequence[Mapping[str, Any]] | None = None,
    reward_metrics: Sequence[Mapping[str, Any]] | None = None,
    samples: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole report as one self-contained HTML page (verdict first)."""
    shown = json_ready(summary)  # the page shows exactly what eval.json holds
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>alignpipe evaluation</title>"
        f"<style>{CSS}</style></head><body><h1>alignpipe evaluation</h1>{_run_header(shown)}"
        f"{_judge(shown)}"
        f"{_verdict(gate)}{_head_to_head(shown)}{render_drift(shown)}{_per_policy(shown)}"
        f"{best_of_n_section(shown)}{overoptimisation_section(shown, ppo_metrics)}"
        f"{_plots(shown, ppo_metrics, reward_metrics)}{_samples(samples)}</body></html>\n"
    )


def eval_record(summary: Mapping[str, Any], gate: Gate) -> dict[str, Any]:
    """What eval.json holds: the verdict, its reasons and the summary, as valid JSON values."""
    return {
        "schema_version": EVAL_JSON_SCHEMA_VERSION,
        "blessed": gate.blessed,
        "reasons": list(gate.reasons),
        "gate_judge": gate.judge,
        "summary": json_ready(summary),
    }


def write_report(
    out_dir: str,
    summary: Mapping[str, Any],
    gate: Gate,
    *,
    ppo_metrics: Sequence[Mapping[str, Any]] | None = None,
    reward_metrics: Sequence[Mapping[str, Any]] | None = None,
    samples: Sequence[Mapping[str, Any]] = (),
) -> ReportPaths:
    """Write report.html and eval.json into ``out_dir`` (local or gs://); returns their paths."""
    fileio.makedirs(out_dir)
    paths = ReportPaths(
        report=fileio.join(out_dir, REPORT_FILE), eval_json=fileio.join(out_dir, EVAL_JSON_FILE)
    )
    page = render_report(
        summary, gate, ppo_metrics=ppo_metrics, reward_metrics=reward_metrics, samples=samples
    )
    fileio.write_text(paths.report, page)
    record = json.dumps(eval_record(summary, gate), indent=2, allow_nan=False, ensure_ascii=False)
    fileio.write_text(paths.eval_json, record + "\n")
    return paths


def select_samples(
    prompts: Sequence[str],
    aligned_responses: Sequence[str],
    reference_responses: Sequence[str],
    aligned_rewards: ArrayLike,
    reference_rewards: ArrayLike,
    *,
    num: int,
    seed: int,
    aligned_gold: ArrayLike | None = None,
    reference_gold: ArrayLike | None = None,
) -> list[dict[str, Any]]:
    """``num`` rows for the report's sample table, drawn without replacement, in input order.

    All arguments hold one entry per response pair (repeat a prompt for each of its samples).
    A random draw rather than the best or worst pairs, so the table shows typical behaviour.
    """
    count = len(prompts)
    columns = [aligned_responses, reference_responses, aligned_rewards, reference_rewards]
    if any(len(column) != count for column in columns):
        raise ValueError(
            f"sample columns differ in length: prompts {count}, others "
            f"{[len(column) for column in columns]}; pass one entry per response pair"
        )
    chosen = np.sort(np.random.default_rng(seed).permutation(count)[: max(num, 0)])
    rows = []
    for i in chosen.tolist():
        row = {
            "prompt": str(prompts[i]),
            "aligned_response": str(aligned_responses[i]),
            "reference_response": str(reference_responses[i]),
            "aligned_reward": float(np.asarray(aligned_rewards)[i]),
            "reference_reward": float(np.asarray(reference_rewards)[i]),
        }
        if aligned_gold is not None and reference_gold is not None:
            row["aligned_gold"] = float(np.asarray(aligned_gold)[i])
            row["reference_gold"] = float(np.asarray(reference_gold)[i])
        rows.append(row)
    return rows
