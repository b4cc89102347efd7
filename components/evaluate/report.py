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

import base64
import html
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from components.core import fileio
from components.evaluate import plots
from components.evaluate.anchor import render_drift
from components.evaluate.gate import Gate
from components.evaluate.measures import JUDGE_GOLD, JUDGE_REWARD_MODEL

EVAL_JSON_SCHEMA_VERSION = 1
REPORT_FILE = "report.html"
EVAL_JSON_FILE = "eval.json"

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { white-space: pre-wrap; max-width: 28em; }
.verdict { padding: 0.6em 1em; border-radius: 6px; }
.blessed { background: #e6f4ea; border: 1px solid #34a853; }
.rejected { background: #fce8e6; border: 1px solid #d93025; }
.missing { color: #777; font-style: italic; }
figure { margin: 1em 0; }
"""


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


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _at(tree: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` (a list's items by number), or None where it is missing."""
    node: Any = tree
    for key in path.split("."):
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, Mapping) and key in node:
            node = node[key]
        else:
            return None
    return node


def format_figure(value: Any) -> str:
    """How the report shows a number: ints whole, floats to 4 significant digits, else n/a."""
    if isinstance(value, bool) or value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return "n/a"


def _figure(summary: Mapping[str, Any], path: str, tag: str = "td") -> str:
    """One number of the summary as an element tagged with its path."""
    css = ' class="num"' if tag == "td" else ""
    text = format_figure(_at(summary, path))
    return f'<{tag}{css} data-key="{_esc(path)}">{_esc(text)}</{tag}>'


def _interval(summary: Mapping[str, Any], path: str) -> str:
    low, high = _figure(summary, f"{path}.low", "span"), _figure(summary, f"{path}.high", "span")
    return f'<td class="num">[{low}, {high}]</td>'


def _gold_judged(summary: Mapping[str, Any]) -> bool:
    """Whether the gold reward judged the responses (no reward model was given)."""
    return _at(summary, "judge") == JUDGE_GOLD


def _judge_name(summary: Mapping[str, Any]) -> str:
    """The judge as the page names it: "reward model", or the gold reward's name."""
    if _gold_judged(summary):
        return _at(summary, "gold.name") or "gold reward"
    return "reward model"


def _judge(summary: Mapping[str, Any]) -> str:
    """The header's line on who scored the responses: the win rate, rewards and best-of-n."""
    if _gold_judged(summary):
        text = (
            f"Judge: the gold reward {_judge_name(summary)}; no reward model was given. The win "
            "rate, the rewards and the best-of-n selection are by the gold reward (best-of-n is "
            "then the oracle baseline), and no reward model's accuracy is measured."
        )
    else:
        gate = (
            f"the gold reward {_at(summary, 'gold.name') or ''}".rstrip()
            if _at(summary, "gate_judge") == JUDGE_GOLD
            else "the reward model (no gold reward is known)"
        )
        text = (
            "Win rate judged by the reward model: the win rate, the rewards and the best-of-n "
            "selection are by its scores; gold figures, where shown, by the gold reward. "
            f"Gate's win-rate rule judged by {gate}."
        )
    judge = _at(summary, "judge") or JUDGE_REWARD_MODEL
    gate_judge = _at(summary, "gate_judge") or judge
    return (
        f'<p class="judge" data-judge="{_esc(judge)}" data-gate-judge="{_esc(gate_judge)}">'
        f"{_esc(text)}</p>"
    )


def _verdict(gate: Gate) -> str:
    """The verdict and its reasons, first on the page."""
    css, title = (
        ("blessed", "Blessed: promote the aligned policy")
        if gate.blessed
        else ("rejected", "Not blessed: keep the current policy")
    )
    reasons = "".join(f"<li>{_esc(reason)}</li>" for reason in gate.reasons)
    blessed = "true" if gate.blessed else "false"
    decider = (
        "The gold reward decided the win-rate rule."
        if gate.judge == JUDGE_GOLD
        else "The reward model decided the win-rate rule: with no gold reward, nothing "
        "independent of what the policy was trained against judged it."
    )
    return (
        f'<div class="verdict {css}" data-blessed="{blessed}" data-gate-judge="{gate.judge}">'
        f"<h2>{_esc(title)}</h2><p>{_esc(decider)}</p><ul>{reasons}</ul></div>"
    )


def _head_to_head_rows(summary: Mapping[str, Any]) -> list[tuple[str, str, str | None]]:
    """(label, value path, interval path) of each head-to-head row; gold rows unless gold
    judged (they would repeat the judge's)."""
    gold_judged = _gold_judged(summary)
    score = _judge_name(summary) if gold_judged else "reward"
    rows = [
        (f"win rate ({_judge_name(summary)})", "win_rate.value", "win_rate"),
        (
            f"mean {score} difference (aligned − reference)",
            "reward.difference.value",
            "reward.difference",
        ),
        ("KL(aligned ‖ reference), nats per token", "kl.per_token", None),
        ("KL(aligned ‖ reference), nats per sequence", "kl.per_sequence", None),
        ("reward-model accuracy on held-out pairs", "reward_model_accuracy.value", None),
    ]
    if _at(summary, "gold") is not None and not gold_judged:
        name = _at(summary, "gold.name") or "gold"
        rows += [
            (f"win rate ({name})", "gold.win_rate.value", "gold.win_rate"),
            (
                f"mean {name} difference (aligned − reference)",
                "gold.difference.value",
                "gold.difference",
            ),
        ]
    return rows


def _head_to_head(summary: Mapping[str, Any]) -> str:
    """Figures that compare the two policies, with their bootstrap intervals."""
    confidence = _at(summary, "confidence")
    level = f"{confidence:.0%}" if isinstance(confidence, float) else "?"
    gold_judged = _gold_judged(summary)
    body = []
    for label, value_path, interval_path in _head_to_head_rows(summary):
        part = value_path.split(".")[0]
        # A part left out is None at its top key; a NaN figure inside one shows as n/a.
        if _at(summary, part) is None:
            why = "no reward model" if gold_judged and part == "reward_model_accuracy" else ""
            cells = f'<td class="num missing">{why or "not measured"}</td><td></td>'
        else:
            interval = _interval(summary, interval_path) if interval_path else "<td></td>"
            cells = _figure(summary, value_path) + interval
        body.append(f"<tr><th>{_esc(label)}</th>{cells}</tr>")
    counts = " ".join(
        f"{_figure(summary, f'win_rate.{key}', 'span')} {key}" for key in ("wins", "ties", "losses")
    )
    verdicts = "Gold-reward verdicts" if gold_judged else "Reward-model verdicts"
    return (
        f"<h2>Aligned against reference</h2><p>{_figure(summary, 'num_prompts', 'span')} "
        f"prompts, {_figure(summary, 'samples_per_prompt', 'span')} sample(s) each; "
        f"{_esc(level)} percentile-bootstrap intervals over prompts. Win rates compare each "
        "aligned sample with each reference draw of its prompt that was not drawn with the "
        "same key (independent pairs: the same key makes both responses identical wherever "
        f"the policies agree). {verdicts} over those pairs: {counts}.{_coupled(summary)}</p>"
        f"<table><tr><th>measure</th><th>value</th><th>{_esc(level)} interval</th>"
        f"</tr>{''.join(body)}</table>"
    )


def _coupled(summary: Mapping[str, Any]) -> str:
    """A sentence with the same-key pairing's win rate and ties, when it was measured."""
    if _at(summary, "win_rate.coupled") is None:
        return ""
    return (
        f" Paired sample s with sample s (same key) it would read "
        f"{_figure(summary, 'win_rate.coupled.value', 'span')}, with "
        f"{_figure(summary, 'win_rate.coupled.ties', 'span')} ties of "
        f"{_figure(summary, 'win_rate.coupled.pairs', 'span')}: not the win rate of two "
        "policies' independent responses."
    )


def _per_policy(summary: Mapping[str, Any]) -> str:
    """Figures of each policy side by side (no gold rows when gold judged: they would repeat)."""
    score = _judge_name(summary) if _gold_judged(summary) else "reward"
    rows = [
        (f"mean {score}", "reward.{}.mean"),
        (f"median {score}", "reward.{}.median"),
        ("mean response length (tokens, EOS included)", "response_length.{}.mean"),
        ("median response length", "response_length.{}.median"),
        ("EOS rate (stopped before max_new_tokens)", "eos_rate.{}"),
    ]
    if _at(summary, "gold") is not None and not _gold_judged(summary):
        name = _at(summary, "gold.name") or "gold"
        rows += [(f"mean {name}", "gold.{}.mean"), (f"median {name}", "gold.{}.median")]
    body = "".join(
        f"<tr><th>{_esc(label)}</th>{_figure(summary, path.format('aligned'))}"
        f"{_figure(summary, path.format('reference'))}</tr>"
        for label, path in rows
    )
    return (
        "<h2>Each policy</h2><table><tr><th>measure</th><th>aligned</th><th>reference</th></tr>"
        f"{body}</table>"
    )


def _image(png: bytes | None, caption: str, missing: str) -> str:
    if png is None:
        return f'<p class="missing">{_esc(missing)}</p>'
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img alt="{_esc(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{_esc(caption)}</figcaption></figure>"
    )


def _plots(
    summary: Mapping[str, Any],
    ppo_metrics: Sequence[Mapping[str, Any]] | None,
    reward_metrics: Sequence[Mapping[str, Any]] | None,
) -> str:
    """Every plot whose data is present; a short note for each that is not."""
    judge, gold_judged = _judge_name(summary), _gold_judged(summary)
    estimates = {judge: _at(summary, "win_rate") or {}}
    if _at(summary, "gold") is not None and not gold_judged:
        estimates[_at(summary, "gold.name") or "gold"] = _at(summary, "gold.win_rate") or {}
    confidence = _at(summary, "confidence") or 0.95
    score, axis, no_curves = (
        (judge, judge, "no reward model (the gold reward judged)")
        if gold_judged
        else ("reward", "reward-model reward", "no reward-model metrics given")
    )
    parts = [
        _image(
            plots.win_rates(estimates, confidence), "win rate with interval", "no win rate plot"
        ),
        _image(
            plots.reward_distributions(_at(summary, "reward_histogram"), axis),
            f"per-prompt {score} distributions",
            "no rewards to plot",
        ),
        _frontier_plot(summary),
        _image(
            plots.ppo_curves(ppo_metrics),
            "PPO training curves (ppo, grpo or rloo)",
            "no PPO metrics given (the policy was not trained by the ppo stage: dpo or sft)",
        ),
        _image(
            plots.reward_model_curves(reward_metrics), "reward-model training curves", no_curves
        ),
    ]
    return "<h2>Plots</h2>" + "".join(parts)


def _frontier_metric(summary: Mapping[str, Any]) -> tuple[str, str, str]:
    """(label, best-of-n key, aligned gain path): gold where known, else the reward model."""
    points = _at(summary, "best_of_n") or []
    if points and all(point.get("gold") is not None for point in points):
        return "gold", "gold", "gold.difference.value"
    return "reward-model score", "reward", "reward.difference.value"


def _frontier_plot(summary: Mapping[str, Any]) -> str:
    """Best-of-n's gain against KL with the aligned policy's point on it."""
    points = _at(summary, "best_of_n") or []
    label, key, aligned_path = _frontier_metric(summary)
    if not points:
        return _image(None, "", "no best-of-n baseline measured")
    base = points[0][key]
    marked = [(p["n"], p["kl_per_sequence"], p[key] - base) for p in points]
    dense = [(p["kl_per_sequence"], p[key] - base) for p in _at(summary, "best_of_n_curve") or []]
    aligned = (_at(summary, "kl.per_sequence"), _at(summary, aligned_path))
    name = f" ({_at(summary, 'gold.name')})" if key == "gold" else ""
    return _image(
        plots.best_of_n_frontier(marked, aligned, label, curve=dense),
        f"{label}{name} gain against KL per sequence: best-of-n of the reference and the "
        "aligned policy",
        "no best-of-n baseline measured",
    )


def _best_of_n(summary: Mapping[str, Any]) -> str:
    """The best-of-n table and the aligned policy's gain as a share of best-of-n's."""
    points = _at(summary, "best_of_n")
    if not points:
        return ""
    rows = "".join(
        f"<tr>{_figure(summary, f'best_of_n.{i}.n')}"
        f"{_figure(summary, f'best_of_n.{i}.kl_per_sequence')}"
        f"{_figure(summary, f'best_of_n.{i}.kl_bound')}"
        f"{_figure(summary, f'best_of_n.{i}.reward')}{_figure(summary, f'best_of_n.{i}.gold')}</tr>"
        for i in range(len(points))
    )
    if _at(summary, "ppo_vs_best_of_n") is None:
        verdict = (
            "No ratio to best-of-n: it needs a gold reward and a positive best-of-n gold gain "
            "at the aligned policy's KL."
        )
        versus = f"<p>{_esc(verdict)}</p>"
    else:
        versus = _versus(summary)
    selector = (
        f"the gold reward {_judge_name(summary)} itself keeps the best of n responses of the "
        "reference to each prompt (the oracle baseline: selection by a perfect reward model)"
        if _gold_judged(summary)
        else "the reward model keeps the best of n responses of the reference to each prompt"
    )
    return (
        f"<h2>Best-of-n baseline</h2><p>For each n {_esc(selector)}. With each prompt's draws "
        "ordered by the judge, best-of-n picks a score level with probability "
        "p = F^n − F_prev^n (ties shared), for any real n ≥ 1: its expected reward and gold, "
        "and its KL to the reference, Σ p log(p/q) with q the level's share of the draws "
        "(Beirami et al. 2024), are exact functions of n, averaged over prompts; n = 1 is the "
        "mean over all draws. The bound log n − (n − 1)/n holds only when no scores tie.</p>"
        "<table><tr><th>n</th><th>KL, nats per sequence</th><th>bound</th>"
        "<th>mean reward</th><th>mean gold</th></tr>"
        f"{rows}</table>{versus}"
    )


def _versus(summary: Mapping[str, Any]) -> str:
    """The aligned gold gain against best-of-n's at the aligned KL: the any-n figure with its
    interval, then what the chord and the bound would read."""
    capped = _at(summary, "ppo_vs_best_of_n_capped")
    note = " (beyond the largest n's KL: compared with the largest n)" if capped else ""
    aligned, best = (
        _figure(summary, f"ppo_vs_best_of_n_gains.{who}", "span")
        for who in ("aligned", "best_of_n")
    )
    interval = ""
    if _at(summary, "ppo_vs_best_of_n_interval") is not None:
        low, high = (
            _figure(summary, f"ppo_vs_best_of_n_interval.{end}", "span") for end in ("low", "high")
        )
        interval = f" [{low}, {high}]"
    text = (
        f"<p>The aligned policy's gold gain, {aligned}, is "
        f"{_figure(summary, 'ppo_vs_best_of_n', 'span')}{interval} times best-of-n's gold "
        f"gain at the same KL of {_figure(summary, 'kl.per_sequence', 'span')} nats per "
        f"sequence, {best}, reached at n = {_figure(summary, 'best_of_n_at_kl.n', 'span')}"
        f"{_esc(note)}.</p>"
    )
    others = [
        ("ppo_vs_best_of_n_chord", "on the chord between the table's n (below best-of-n's "
         "concave curve, which flatters the aligned policy)"),
        ("ppo_vs_best_of_n_bound", "with best-of-n placed at the bound's KL (it overstates "
         "best-of-n's KL when the judge's scores tie, which flatters the aligned policy)"),
    ]  # fmt: skip
    for key, how in others:
        if _at(summary, key) is not None:
            text += f"<p>The ratio {_esc(how)} would read {_figure(summary, key, 'span')}.</p>"
    return text


def _reward_cell(value: Any) -> str:
    number = (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    )
    return f'<td class="num">{_esc(format_figure(number))}</td>'


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
            f'<td class="text">{_esc(sample.get("prompt", ""))}</td>',
            f'<td class="text">{_esc(sample.get("aligned_response", ""))}</td>',
            _reward_cell(sample.get("aligned_reward")),
            f'<td class="text">{_esc(sample.get("reference_response", ""))}</td>',
            _reward_cell(sample.get("reference_reward")),
        ]
        if has_gold:
            cells += [
                _reward_cell(sample.get("aligned_gold")),
                _reward_cell(sample.get("reference_gold")),
            ]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    header = "".join(f"<th>{_esc(h)}</th>" for h in head)
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
        f"<style>{_CSS}</style></head><body><h1>alignpipe evaluation</h1>{_judge(shown)}"
        f"{_verdict(gate)}{_head_to_head(shown)}{render_drift(shown)}{_per_policy(shown)}"
        f"{_best_of_n(shown)}"
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
