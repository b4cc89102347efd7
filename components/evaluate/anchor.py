"""Drift from the anchor: the aligned policy measured against a fixed earlier policy.

A periodic run is measured against its reference, the policy it started from; the anchor
(the first policy ever promoted, typically the original SFT or base policy) stays fixed from
run to run, so KL to the anchor shows how far a chain of runs has drifted, which each run's
own KL cannot.

Cheap by design: KL(aligned ‖ anchor) is the k3 estimate on the aligned samples already
drawn, so it needs only the anchor's log-probs of them (one forward pass). The win rate
against the anchor draws :data:`ANCHOR_SAMPLES_PER_PROMPT` anchor response per prompt and
pairs every aligned sample of a prompt with it but the one drawn with the same key (an
independent pair, as the reference's win rate); the bootstrap over prompts keeps the
interval honest about that sharing. When the anchor is the reference, its figures are the
reference's and nothing is measured again.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from components.evaluate.config import EvalConfig
from components.evaluate.measures import (
    PolicyOutputs,
    kl_estimator,
    paired_difference,
    per_prompt,
    sequence_kl,
    win_rate_with_interval,
)

# One anchor response per prompt: the win rate against the anchor is a drift signal, not the
# gate's headline, and one draw keeps the added sampling to 1 / (samples + best-of-n draws).
ANCHOR_SAMPLES_PER_PROMPT = 1
# Columns of the drift table: (title, key of a past row, format).
DRIFT_COLUMNS = (
    ("KL to anchor", "anchor_kl", "{:.4f}"),
    ("win rate vs anchor", "anchor_win_rate", "{:.3f}"),
    ("gold gain vs anchor", "anchor_gold_gain", "{:+.3f}"),
    ("KL to reference", "kl", "{:.4f}"),
)


def anchor_draws(config: EvalConfig) -> int:
    """Anchor responses per prompt: one, or two when one aligned sample shares its key with
    the first (no independent pair otherwise)."""
    single = config.samples_per_prompt == 1 and not config.greedy
    return ANCHOR_SAMPLES_PER_PROMPT + int(single)


def anchor_summary(
    aligned: PolicyOutputs,
    anchor_rewards: ArrayLike,
    anchor_gold: ArrayLike | None,
    *,
    aligned_logprobs: ArrayLike,
    anchor_logprobs: ArrayLike,
    config: EvalConfig,
    uri: str,
) -> dict[str, Any]:
    """KL to the anchor, and the win rate and gold gain against its [P, A] samples."""
    bootstrap = {"n_resamples": config.bootstrap_samples, "confidence": config.confidence,
                 "seed": config.seed}  # fmt: skip
    rewards = np.asarray(aligned.rewards, np.float64)
    gold = None
    if aligned.gold_rewards is not None and anchor_gold is not None:
        a_gold = np.asarray(aligned.gold_rewards, np.float64)
        gold = {
            "difference": paired_difference(
                per_prompt(a_gold), per_prompt(anchor_gold), **bootstrap
            )["difference"],
            "win_rate": win_rate_with_interval(
                a_gold, anchor_gold, shared_keys=not config.greedy, **bootstrap
            ),
        }
    return {
        "uri": uri,
        "same_as_reference": False,
        "samples_per_prompt": int(np.shape(anchor_rewards)[1]),
        "kl": sequence_kl(
            aligned_logprobs, anchor_logprobs, aligned.response_mask, kl_estimator(config)
        ),
        "win_rate": win_rate_with_interval(
            rewards, anchor_rewards, shared_keys=not config.greedy, **bootstrap
        ),
        "gold": gold,
    }


def from_reference(summary: Mapping[str, Any], uri: str) -> dict[str, Any]:
    """The anchor part when the anchor is the reference: the reference's figures, no new cost."""
    gold = summary.get("gold")
    return {
        "uri": uri,
        "same_as_reference": True,
        "samples_per_prompt": summary["samples_per_prompt"],
        "kl": summary["kl"],
        "win_rate": summary["win_rate"],
        "gold": None if gold is None else {k: gold[k] for k in ("difference", "win_rate")},
    }


def drift_row(summary: Mapping[str, Any], label: str) -> dict[str, Any]:
    """One row of the drift table from an evaluation's summary (this run's or a promotion's)."""
    anchor = summary.get("anchor") or {}
    gold = anchor.get("gold") or {}
    return {
        "label": label,
        "anchor_kl": (anchor.get("kl") or {}).get("per_token"),
        "anchor_win_rate": (anchor.get("win_rate") or {}).get("value"),
        "anchor_gold_gain": (gold.get("difference") or {}).get("value"),
        "kl": (summary.get("kl") or {}).get("per_token"),
    }


def _cell(value: Any, fmt: str) -> str:
    shown = fmt.format(value) if isinstance(value, int | float) else "n/a"
    return f'<td class="num">{html.escape(shown)}</td>'


def render_drift(summary: Mapping[str, Any]) -> str:
    """The report's section: this run against the anchor, below the past promotions' drift."""
    anchor = summary.get("anchor")
    if not anchor:
        return ""
    same = " (the anchor is this run's reference)" if anchor.get("same_as_reference") else ""
    past: Sequence[Mapping[str, Any]] = anchor.get("past") or []
    rows = [*past, drift_row(summary, "this run")]
    head = "".join(f"<th>{html.escape(title)}</th>" for title, _, _ in DRIFT_COLUMNS)
    body = "".join(
        f"<tr><th>{html.escape(str(row.get('label', '')))}</th>"
        + "".join(_cell(row.get(key), fmt) for _, key, fmt in DRIFT_COLUMNS)
        + "</tr>"
        for row in rows
    )
    return (
        f"<h2>Drift from the anchor</h2><p>Anchor: <code>{html.escape(str(anchor['uri']))}"
        f"</code>{html.escape(same)}. KL in nats per response token on the aligned samples; "
        f"win rate by the judge against {anchor['samples_per_prompt']} anchor sample(s) per "
        f"prompt. Past promotions first, from the promotion history.</p>"
        f'<table data-key="anchor"><tr><th>policy</th>{head}</tr>{body}</table>'
    )
