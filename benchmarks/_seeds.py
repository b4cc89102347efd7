"""bench_algorithms' figures over seeds: each headline figure's mean and spread, the
training rollouts' KL against its target, the table and the targets judged over seeds."""

from __future__ import annotations

from typing import Any

import numpy as np

from components.core.training.metrics import read_metrics
from components.evaluate.plots import TARGET_BAND


def rollout_kl(output: str) -> dict[str, float] | None:
    """The training rollouts' KL per token after the first tenth of the run: its mean over
    ``kl_target``, and the share of rollouts within ±50% of it (None for dpo)."""
    rows = [row for row in read_metrics(output) if "objective/kl_per_token" in row]
    if not rows or "objective/kl_target" not in rows[-1]:
        return None
    target = rows[-1]["objective/kl_target"]
    warm_up = -(-len(rows) // 10)  # a tenth of the rollouts, rounded up
    kls = np.array([row["objective/kl_per_token"] for row in rows[warm_up:]])
    return {
        "mean_over_target": float(kls.mean() / target),
        "in_band": float(np.mean(np.abs(kls / target - 1) <= TARGET_BAND)),
    }


def spread(values: list[float | None]) -> dict[str, float] | None:
    """Mean, min and max over seeds (None when any seed has no figure)."""
    if not values or any(value is None for value in values):
        return None
    array = np.asarray(values, np.float64)
    return {"mean": float(array.mean()), "min": float(array.min()), "max": float(array.max())}


def over_seeds(rows: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per algorithm, each headline figure's mean and spread over the seeds."""
    seeds = sorted(rows)
    figures = {
        "gold_gain": lambda row: row["gold_gain"]["value"],
        "gold_win_rate": lambda row: row["gold_win_rate"],
        "gold_win_rate_coupled": lambda row: row.get("gold_win_rate_coupled"),
        "kl_per_token": lambda row: row["kl_per_token"],
        "rollout_kl_over_target": lambda row: (row["rollout_kl"] or {}).get("mean_over_target"),
        "rollout_kl_in_band": lambda row: (row["rollout_kl"] or {}).get("in_band"),
        "vs_best_of_n": lambda row: row["vs_best_of_n"],
        "vs_best_of_n_bound": lambda row: row["vs_best_of_n_bound"],
        "vs_best_of_n_chord": lambda row: row.get("vs_best_of_n_chord"),
    }
    return {
        name: {key: spread([get(rows[s][name]) for s in seeds]) for key, get in figures.items()}
        for name in rows[seeds[0]]
    }


def _cell(figure: dict[str, float] | None, form: str) -> str:
    if figure is None:
        return "n/a"
    return f"{figure['mean']:{form}} [{figure['min']:{form}}, {figure['max']:{form}}]"


def format_seed_table(summary: dict[str, dict[str, Any]], seeds: list[int]) -> str:
    """One line per algorithm: mean [min, max] over the seeds."""
    columns = (
        ("gold gain", "gold_gain", "+.3f"), ("gold win", "gold_win_rate", ".3f"),
        ("gold win (coupled)", "gold_win_rate_coupled", ".3f"),
        ("KL/token", "kl_per_token", ".4f"), ("train KL/target", "rollout_kl_over_target", ".2f"),
        ("in ±50%", "rollout_kl_in_band", ".2f"), ("vs BoN", "vs_best_of_n", ".2f"),
        ("vs BoN (chord)", "vs_best_of_n_chord", ".2f"),
    )  # fmt: skip
    lines = [f"over seeds {', '.join(map(str, seeds))}: mean [min, max]"]
    lines.append(f"{'algorithm':<9} " + " ".join(f"{label:>26}" for label, _, _ in columns))
    for name, figures in summary.items():
        cells = " ".join(f"{_cell(figures[key], form):>26}" for _, key, form in columns)
        lines.append(f"{name:<9} {cells}")
    return "\n".join(lines)


def seed_targets(
    summary: dict[str, dict[str, Any]], kl_target: float, algorithms: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Over seeds: each RL algorithm's mean KL per token within ±20% of the target, on its
    training rollouts (after the first tenth: what the controller steers) and on the eval
    prompts; every such rollout of every seed within ±50% of it; and its mean
    ppo_vs_best_of_n (any-n curve) at least 1.0."""
    checks = []
    for name in algorithms:
        ratio, versus = summary[name]["rollout_kl_over_target"], summary[name]["vs_best_of_n"]
        evaluated, in_band = summary[name]["kl_per_token"], summary[name]["rollout_kl_in_band"]
        checks.append(
            {
                "target": f"{name}'s mean KL per token within ±20% of kl_target {kl_target}, "
                "on its rollouts and on the eval prompts",
                "met": ratio is not None
                and abs(ratio["mean"] - 1) <= 0.2
                and abs(evaluated["mean"] / kl_target - 1) <= 0.2,
                "figures": f"rollouts {_cell(ratio, '.2f')}x the target; eval prompts "
                f"{_cell(evaluated, '.4f')} nats/token",
            }
        )
        checks.append(
            {
                "target": f"every rollout of {name} after the first tenth within "
                f"±{TARGET_BAND:.0%} of kl_target, every seed",
                "met": in_band is not None and in_band["min"] == 1.0,
                "figures": f"share in the band {_cell(in_band, '.3f')}",
            }
        )
        checks.append(
            {
                "target": f"{name}'s mean ppo_vs_best_of_n (any-n curve) at least 1.0",
                "met": versus is not None and versus["mean"] >= 1.0,
                "figures": _cell(versus, ".2f"),
            }
        )
    return checks
