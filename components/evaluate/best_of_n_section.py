"""The report's best-of-n section: the frontier table, the aligned policy's gain against
best-of-n's at its KL (any-n curve, chord, bound) and the frontier plot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from components.evaluate import plots
from components.evaluate.page import at, esc, figure, image, is_gold_judged, judge_name


def frontier_metric(summary: Mapping[str, Any]) -> tuple[str, str, str]:
    """(label, best-of-n key, aligned gain path): gold where known, else the reward model."""
    points = at(summary, "best_of_n") or []
    if points and all(point.get("gold") is not None for point in points):
        return "gold", "gold", "gold.difference.value"
    return "reward-model score", "reward", "reward.difference.value"


def frontier_plot(summary: Mapping[str, Any]) -> str:
    """Best-of-n's gain against KL with the aligned policy's point on it."""
    points = at(summary, "best_of_n") or []
    label, key, aligned_path = frontier_metric(summary)
    if not points:
        return image(None, "", "no best-of-n baseline measured")
    base = points[0][key]
    marked = [(p["n"], p["kl_per_sequence"], p[key] - base) for p in points]
    dense = [(p["kl_per_sequence"], p[key] - base) for p in at(summary, "best_of_n_curve") or []]
    aligned = (at(summary, "kl.per_sequence"), at(summary, aligned_path))
    name = f" ({at(summary, 'gold.name')})" if key == "gold" else ""
    return image(
        plots.best_of_n_frontier(marked, aligned, label, curve=dense),
        f"{label}{name} gain against KL per sequence: best-of-n of the reference and the "
        "aligned policy",
        "no best-of-n baseline measured",
    )


def best_of_n_section(summary: Mapping[str, Any]) -> str:
    """The best-of-n table and the aligned policy's gain as a share of best-of-n's."""
    points = at(summary, "best_of_n")
    if not points:
        return ""
    rows = "".join(
        f"<tr>{figure(summary, f'best_of_n.{i}.n')}"
        f"{figure(summary, f'best_of_n.{i}.kl_per_sequence')}"
        f"{figure(summary, f'best_of_n.{i}.kl_bound')}"
        f"{figure(summary, f'best_of_n.{i}.reward')}{figure(summary, f'best_of_n.{i}.gold')}</tr>"
        for i in range(len(points))
    )
    if at(summary, "ppo_vs_best_of_n") is None:
        verdict = (
            "No ratio to best-of-n: it needs a gold reward and a positive best-of-n gold gain "
            "at the aligned policy's KL."
        )
        versus = f"<p>{esc(verdict)}</p>"
    else:
        versus = versus_paragraphs(summary)
    selector = (
        f"the gold reward {judge_name(summary)} itself keeps the best of n responses of the "
        "reference to each prompt (the oracle baseline: selection by a perfect reward model)"
        if is_gold_judged(summary)
        else "the reward model keeps the best of n responses of the reference to each prompt"
    )
    return (
        f"<h2>Best-of-n baseline</h2><p>For each n {esc(selector)}. With each prompt's draws "
        "ordered by the judge, best-of-n picks a score level with probability "
        "p = F^n − F_prev^n (ties shared), for any real n ≥ 1: its expected reward and gold, "
        "and its KL to the reference, Σ p log(p/q) with q the level's share of the draws "
        "(Beirami et al. 2024), are exact functions of n, averaged over prompts; n = 1 is the "
        "mean over all draws. The bound log n − (n − 1)/n holds only when no scores tie.</p>"
        "<table><tr><th>n</th><th>KL, nats per sequence</th><th>bound</th>"
        "<th>mean reward</th><th>mean gold</th></tr>"
        f"{rows}</table>{versus}"
    )


def versus_paragraphs(summary: Mapping[str, Any]) -> str:
    """The aligned gold gain against best-of-n's at the aligned KL: the any-n figure with its
    interval, then what the chord and the bound would read."""
    capped = at(summary, "ppo_vs_best_of_n_capped")
    note = " (beyond the largest n's KL: compared with the largest n)" if capped else ""
    aligned, best = (
        figure(summary, f"ppo_vs_best_of_n_gains.{who}", "span") for who in ("aligned", "best_of_n")
    )
    interval = ""
    if at(summary, "ppo_vs_best_of_n_interval") is not None:
        low, high = (
            figure(summary, f"ppo_vs_best_of_n_interval.{end}", "span") for end in ("low", "high")
        )
        interval = f" [{low}, {high}]"
    text = (
        f"<p>The aligned policy's gold gain, {aligned}, is "
        f"{figure(summary, 'ppo_vs_best_of_n', 'span')}{interval} times best-of-n's gold "
        f"gain at the same KL of {figure(summary, 'kl.per_sequence', 'span')} nats per "
        f"sequence, {best}, reached at n = {figure(summary, 'best_of_n_at_kl.n', 'span')}"
        f"{esc(note)}.</p>"
    )
    others = [
        ("ppo_vs_best_of_n_chord", "on the chord between the table's n (below best-of-n's "
         "concave curve, which flatters the aligned policy)"),
        ("ppo_vs_best_of_n_bound", "with best-of-n placed at the bound's KL (it overstates "
         "best-of-n's KL when the judge's scores tie, which flatters the aligned policy)"),
    ]  # fmt: skip
    for key, how in others:
        if at(summary, key) is not None:
            text += f"<p>The ratio {esc(how)} would read {figure(summary, key, 'span')}.</p>"
    return text
