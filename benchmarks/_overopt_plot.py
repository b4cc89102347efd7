"""bench_overoptimisation's plot: proxy, held-out and gold gains against KL to the sft
policy, one row of panels per setting and one panel per seed, the selected checkpoint marked."""

from __future__ import annotations


def plot(results: dict[str, dict[int, dict]], path: str) -> None:
    """One row of panels per setting, one panel per seed."""
    from matplotlib.figure import Figure

    columns = max(len(seeds) for seeds in results.values())
    figure = Figure(figsize=(4 * columns, 3.4 * len(results)))
    panels = figure.subplots(len(results), columns, squeeze=False)
    for row_axes, (name, by_seed) in zip(panels, results.items(), strict=True):
        for axes, (seed, result) in zip(row_axes, by_seed.items(), strict=False):
            rows = result["curve"]
            kl = [row["kl_per_token"] for row in rows]
            for judge_name, color in (("proxy", "tab:blue"), ("heldout", "tab:orange")):
                gains = [row[judge_name] - rows[0][judge_name] for row in rows]
                axes.plot(kl, gains, "o-", color=color, label=f"{judge_name} gain (z)",
                          markersize=3)  # fmt: skip
            gold = axes.twinx()
            gold.plot(kl, [row["gold"] - rows[0]["gold"] for row in rows], "s--",
                      color="black", label="gold gain", markersize=3)  # fmt: skip
            chosen = next(r for r in rows if r["iteration"] == result["figures"]["selected"])
            gold.axvline(chosen["kl_per_token"], color="tab:green", linewidth=1, label="selected")
            axes.set_xlabel("KL to the sft policy (nats per token)")
            axes.set_title(f"{name}, seed {seed}")
            if axes is row_axes[0]:
                axes.set_ylabel("reward-model gain (eval stds)")
                axes.legend(fontsize="small", loc="upper left")
                gold.legend(fontsize="small", loc="lower right")
            gold.set_ylabel("gold gain")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
