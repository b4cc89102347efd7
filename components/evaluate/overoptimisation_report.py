"""The report's over-optimisation section: the figures overoptimisation.py measured and
the ppo stage's drift monitors per rollout (plots.drift_curves)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from components.evaluate import plots
from components.evaluate.page import at, esc, figure, image

ROWS = (
    ("judge's gain (proxy, eval stds)", "proxy_gain.difference.value", "the judge"),
    ("held-out reward model's gain", "heldout_gain.difference.value", "held-out reward model"),
    ("gap: judge's gain − held-out's", "gap", "both"),
    ("ensemble spread on the aligned samples", "disagreement.aligned", "reward ensemble"),
    ("ensemble spread on the reference's", "disagreement.reference", "reward ensemble"),
    ("ensemble spread ratio", "disagreement.ratio", "reward ensemble"),
    ("mean response length over the reference's", "length_ratio", "—"),
)


def overoptimisation_section(
    summary: Mapping[str, Any], ppo_metrics: Sequence[Mapping[str, Any]] | None
) -> str:
    """The figures present, and the drift plot when the ppo stage logged its monitors."""
    part = at(summary, "overoptimisation")
    if not part:
        return ""
    rows = "".join(
        f"<tr><th>{esc(label)}</th>{figure(summary, 'overoptimisation.' + path)}"
        f"<td>{esc(judge)}</td></tr>"
        for label, path, judge in ROWS
        if at(part, path) is not None
    )
    plot = image(
        plots.drift_curves(ppo_metrics),
        "drift monitors per rollout (ppo stage)",
        "no drift monitors logged (the policy was not trained by the ppo stage)",
    )
    return (
        "<h2>Over-optimisation</h2><p>What reward models the policy was not trained against "
        "say of the same samples: a judge's gain the held-out model does not share, or an "
        "ensemble that disagrees more on the aligned samples than on the reference's, is "
        "gain from gaming the judge. Gains are in each model's eval standard deviations.</p>"
        f"<table><tr><th>measure</th><th>value</th><th>judged by</th></tr>{rows}</table>{plot}"
    )
