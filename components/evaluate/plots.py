"""The report's figures as PNG bytes, drawn with matplotlib's Agg canvas (no display, no pyplot).

Each function returns None when its data is absent, so the report simply leaves that plot out.
Figures are built as ``matplotlib.figure.Figure`` objects rather than through pyplot: no global
figure registry, nothing to close, safe in a server or a test run.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

ALIGNED_COLOR = "#1f77b4"
REFERENCE_COLOR = "#ff7f0e"
GUARD_COLOR = "#d62728"
# PPO metric names as the PPO stage logs them (TRL's names); the first panel plots rewards.
PPO_REWARD_KEYS = ("objective/scores", "objective/rlhf_reward", "objective/non_score_reward")
PPO_KL_KEYS = ("objective/kl_per_token",)  # what the KL controller steers
PPO_KL_TARGET_KEY = "objective/kl_target"
TARGET_COLOR = "#2ca02c"
# The band the controller is held to after its warm-up: each rollout's KL within ±50%.
TARGET_BAND = 0.5
# A reward function's mean per rollout, as the ppo stage logs it (TRL's name).
REWARD_FUNCTION_KEY = re.compile(r"rewards/[^/]+/mean")


def _png(figure: Figure) -> bytes:
    """The figure encoded as PNG."""
    FigureCanvasAgg(figure)
    figure.tight_layout()
    buffer = io.BytesIO()
    # No Software/date metadata: the same data gives the same bytes.
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    return buffer.getvalue()


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` over the rows that hold a finite value for it.

    The step is the row's ``step`` when it has one, else the row's position.
    """
    steps, values = [], []
    for position, row in enumerate(rows):
        value = row.get(key)
        if _is_finite_number(value):
            step = row.get("step")
            steps.append(float(step) if _is_finite_number(step) else float(position))
            values.append(float(value))
    return steps, values


def _plot_series(axes: Any, rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> bool:
    """Draw each key that has data on ``axes``; whether anything was drawn."""
    drawn = False
    for key in keys:
        steps, values = series(rows, key)
        if values:
            axes.plot(steps, values, marker="." if len(values) < 30 else None, label=key)
            drawn = True
    if drawn:
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return drawn


def _mark_events(axes: Any, rows: Sequence[Mapping[str, Any]]) -> int:
    """A dashed line at every event row's step (PPO's guard restorations); returns how many."""
    events = [row for row in rows if "event" in row and _is_finite_number(row.get("step"))]
    for i, row in enumerate(events):
        label = "guard restoration" if i == 0 else None
        axes.axvline(row["step"], color=GUARD_COLOR, linestyle="--", linewidth=1, label=label)
    return len(events)


def ppo_curves(rows: Sequence[Mapping[str, Any]] | None) -> bytes | None:
    """PPO rewards and KL (per sequence, as PPO logs it) over training steps; the rows' events
    (``metrics.read_events``: guard restorations) as dashed lines, not as steps going back."""
    if not rows:
        return None
    figure = Figure(figsize=(9, 3.2))
    reward_axes, kl_axes = figure.subplots(1, 2)
    has_reward = _plot_series(reward_axes, rows, PPO_REWARD_KEYS)
    has_kl = _plot_series(kl_axes, rows, PPO_KL_KEYS)
    if has_kl:
        mark_kl_target(kl_axes, rows)
    if not (has_reward or has_kl):
        return None
    for axes in (reward_axes, kl_axes):
        if _mark_events(axes, rows):
            axes.legend(fontsize="small")
    reward_axes.set_title("PPO reward" if has_reward else "PPO reward: not logged")
    kl_axes.set_title("PPO KL (nats per token)" if has_kl else "PPO KL: not logged")
    return _png(figure)


def mark_kl_target(axes: Any, rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The KL controller's target as a line, and the ±50% band around it; returns the target
    (None when the rows hold none: a fixed kl_coef)."""
    _, targets = series(rows, PPO_KL_TARGET_KEY)
    if not targets:
        return None
    target = targets[-1]
    axes.axhline(target, color=TARGET_COLOR, linestyle="--", linewidth=1, label="KL target")
    low, high = target * (1 - TARGET_BAND), target * (1 + TARGET_BAND)
    axes.axhspan(low, high, color=TARGET_COLOR, alpha=0.1, label="target ±50%")
    axes.legend(fontsize="small")
    return target


def reward_model_curves(rows: Sequence[Mapping[str, Any]] | None) -> bytes | None:
    """Reward-model loss and accuracy over training steps, from any keys ending in those names."""
    if not rows:
        return None
    keys = sorted({key for row in rows for key in row})
    loss_keys = [key for key in keys if key.endswith("loss")]
    accuracy_keys = [key for key in keys if key.endswith("accuracy")]
    figure = Figure(figsize=(9, 3.2))
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    has_loss = _plot_series(loss_axes, rows, loss_keys)
    has_accuracy = _plot_series(accuracy_axes, rows, accuracy_keys)
    if not (has_loss or has_accuracy):
        return None
    loss_axes.set_title("reward-model loss" if has_loss else "loss: not logged")
    accuracy_axes.set_title("reward-model accuracy" if has_accuracy else "accuracy: not logged")
    return _png(figure)


def reward_distributions(
    histogram: Mapping[str, Sequence[float]] | None, judge: str = "reward-model reward"
) -> bytes | None:
    """Both policies' per-prompt reward histograms over shared bins, scored by ``judge``."""
    if not histogram or len(histogram.get("bin_edges", ())) < 2:
        return None
    edges = list(histogram["bin_edges"])
    figure = Figure(figsize=(6, 3.2))
    axes = figure.subplots()
    for name, color in (("reference", REFERENCE_COLOR), ("aligned", ALIGNED_COLOR)):
        axes.stairs(histogram[name], edges, fill=True, alpha=0.45, color=color, label=name)
    axes.set_xlabel(f"{judge} (per prompt)")
    axes.set_ylabel("prompts")
    axes.set_title("reward distributions")
    axes.legend(fontsize="small")
    return _png(figure)


def win_rates(estimates: Mapping[str, Mapping[str, float]], confidence: float) -> bytes | None:
    """Each named win rate as a point with its interval, against the 0.5 parity line."""
    shown = {
        name: est
        for name, est in estimates.items()
        if all(_is_finite_number(est.get(k)) for k in ("value", "low", "high"))
    }
    if not shown:
        return None
    figure = Figure(figsize=(6, 0.9 + 0.5 * len(shown)))
    axes = figure.subplots()
    for row, est in enumerate(shown.values()):
        below, above = est["value"] - est["low"], est["high"] - est["value"]
        axes.errorbar(
            est["value"], row, xerr=[[max(below, 0.0)], [max(above, 0.0)]], fmt="o", capsize=4
        )
    axes.axvline(0.5, color="grey", linestyle="--", linewidth=1)
    # A user's gold reward is named by its spec, maybe a long path: keep its tail.
    labels = [name if len(name) <= 32 else "…" + name[-31:] for name in shown]
    axes.set_yticks(range(len(shown)), labels)
    axes.set_ylim(-0.6, len(shown) - 0.4)
    axes.set_xlim(0.0, 1.0)
    axes.set_xlabel(f"win rate of aligned over reference ({confidence:.0%} interval)")
    return _png(figure)


def best_of_n_frontier(
    points: Sequence[tuple[int, float, float]],
    aligned: tuple[float, float] | None,
    metric: str,
    curve: Sequence[tuple[float, float]] = (),
) -> bytes | None:
    """Best-of-n's (KL per sequence, gain) curve (``curve``: its points at many real n,
    else straight lines between ``points``), each of ``points`` marked n, and the aligned
    policy."""
    shown = [p for p in points if _is_finite_number(p[1]) and _is_finite_number(p[2])]
    if not shown:
        return None
    figure = Figure(figsize=(6, 3.6))
    axes = figure.subplots()
    line = [p for p in curve if _is_finite_number(p[0]) and _is_finite_number(p[1])]
    line = line or [(p[1], p[2]) for p in shown]
    axes.plot(*zip(*line, strict=True), color=REFERENCE_COLOR, label="best-of-n of the reference")
    axes.plot([p[1] for p in shown], [p[2] for p in shown], marker="o", linestyle="",
              color=REFERENCE_COLOR)  # fmt: skip
    for n, kl, gain in shown:
        axes.annotate(f"n={n}", (kl, gain), textcoords="offset points", xytext=(4, -10))
    if aligned is not None and all(_is_finite_number(v) for v in aligned):
        axes.plot(*aligned, marker="*", markersize=14, linestyle="", color=ALIGNED_COLOR,
                  label="aligned policy")  # fmt: skip
    axes.axhline(0.0, color="grey", linestyle="--", linewidth=1)
    axes.set_xlabel("KL(· ‖ reference), nats per sequence")
    axes.set_ylabel(f"{metric} gain over the reference")
    axes.set_title(f"{metric} against KL: aligned policy and best-of-n")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return _png(figure)


def reward_function_curves(
    rows: Sequence[Mapping[str, Any]] | None, *, verifier: str | None = None
) -> bytes | None:
    """Each reward function's mean per rollout (``rewards/<name>/mean``, TRL's tag) over
    training steps; the ``verifier``'s (full marks = correct, 0 otherwise: exact-match) is
    the share of the rollout's samples answered correctly, and is labelled so."""
    if not rows:
        return None
    names = sorted(
        {key.split("/")[1] for row in rows for key in row if REWARD_FUNCTION_KEY.fullmatch(key)}
    )
    figure = Figure(figsize=(6, 3.2))
    axes = figure.subplots()
    drawn = False
    for name in names:
        steps, values = series(rows, f"rewards/{name}/mean")
        if values:
            label = f"{name}: sampled accuracy" if name == verifier else name
            axes.plot(steps, values, marker="." if len(values) < 30 else None, label=label)
            drawn = True
    if not drawn:
        return None
    axes.set_xlabel("step")
    axes.set_ylabel("mean over the rollout's responses")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    title = "mean reward per rollout, by function"
    if names == [verifier]:
        title = f"sampled accuracy per rollout ({verifier})"
    axes.set_title(title)
    return _png(figure)


# The over-optimisation monitors as the ppo stage logs them (ppo/monitors.py, ppo/loop.py).
DRIFT_PANELS = (
    ("reward gain (eval stds)", ("overopt/proxy_gain", "overopt/heldout_gain", "overopt/gap")),
    ("length and EOS", ("response_length_ratio", "eos_fraction")),
    ("ensemble spread, entropy a token", ("overopt/ensemble_std", "objective/entropy_per_token")),
)


def drift_curves(rows: Sequence[Mapping[str, Any]] | None) -> bytes | None:
    """The drift monitors per rollout: proxy and held-out gains and their gap; the response
    length over the reference's and the EOS share; the ensemble's spread and the entropy per
    token.
    None when the rows hold none of them."""
    if not rows:
        return None
    figure = Figure(figsize=(12, 3.2))
    drawn = False
    panels = figure.subplots(1, len(DRIFT_PANELS))
    for axes, (title, keys) in zip(panels, DRIFT_PANELS, strict=True):
        shown = _plot_series(axes, rows, keys)
        axes.set_title(title if shown else f"{title}: not logged")
        if shown:
            axes.legend(fontsize="small")
        drawn = drawn or shown
    return _png(figure) if drawn else None
