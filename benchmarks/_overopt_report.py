"""bench_overoptimisation's tables: per seed, where gold and the held-out model peaked, what
selection kept, where the early stop would have stopped, and the gate's verdicts on the
selected and the last policy, with gold and without it; then the issue's targets, met or not."""

from __future__ import annotations

from typing import Any


def report(results: dict[int, dict[str, Any]], patiences: tuple[int, ...]) -> None:
    """One setting's tables: the curves' figures, the verdicts with and without gold, and
    the targets met or not."""
    print("seed  gold peak  held-out peak  lag  gold drop  proxy rise  selected  sel/best  "
          f"last/best  early stop at heldout_patience {'/'.join(map(str, patiences))}")  # fmt: skip
    for seed, result in results.items():
        f = result["figures"]
        print(
            f"{seed:>4}  {f['gold_peak']:>9}  {f['heldout_peak']:>13}  {f['lag']:>3}  "
            f"{f['gold_drop']:>9.3f}  {f['proxy_rise_after_gold_peak']:>+10.3f}  "
            f"{f['selected']:>8}  {f['selected_share']:>8.2f}  {f['last_share']:>9.2f}  "
            f"{'/'.join(str(f['early_stop'][p]) for p in patiences)}"
        )
    print("seed  policy    blessed  win rate  LC win rate  gold win  gold LC  held-out gain  "
          "gap  failed rules")  # fmt: skip
    for seed, result in results.items():
        for policy, v in result["verdicts"].items():
            print(
                f"{seed:>4}  {policy:<8}  {str(v['blessed']):<7}  {v['win_rate']:>8.3f}  "
                f"{v['lc_win_rate'] or float('nan'):>11.3f}  {v['gold_win_rate']:>8.3f}  "
                f"{v['gold_lc_win_rate'] or float('nan'):>7.3f}  {v['heldout_gain']:>+13.3f}  "
                f"{v['gap']:>+5.2f}  {'; '.join(v['failed']) or '-'}"
            )
    shares = [r["figures"]["selected_share"] for r in results.values()]
    lasts = [r["figures"]["last_share"] for r in results.values()]
    lags = [r["figures"]["lag"] for r in results.values()]
    print(
        f"target: the selected checkpoint >= 90% of the best one's gold gain, the last less: "
        f"{'met' if min(shares) >= 0.9 and max(lasts) < min(shares) else 'NOT met'} "
        f"(selected {[round(s, 2) for s in shares]}, last {[round(s, 2) for s in lasts]})"
    )
    print(f"held-out peak minus gold peak (iterations): {lags}")
    print("the gate without gold (the proxy's win rate in place of gold's):")
    for seed, result in results.items():
        for policy, v in result["verdicts"].items():
            failed = "; ".join(v["failed_without_gold"]) or "-"
            print(f"{seed:>4}  {policy:<8}  {str(v['blessed_without_gold']):<7}  {failed}")
    refused = all(not r["verdicts"]["last"]["blessed_without_gold"] for r in results.values())
    promoted = all(r["verdicts"]["selected"]["blessed_without_gold"] for r in results.values())
    print(f"target: the gate, without gold, refuses the last policy and blesses the selected "
          f"one: {'met' if refused and promoted else 'NOT met'}")  # fmt: skip
    for seed, result in results.items():
        selected, last = result["verdicts"]["selected"], result["verdicts"]["last"]
        moves = {key: last[key] - selected[key] for key in
                 ("win_rate", "lc_win_rate", "gold_win_rate") if last[key] is not None
                 and selected[key] is not None}  # fmt: skip
        print(f"seed {seed}, last minus selected: proxy win rate {moves.get('win_rate', 0):+.3f}, "
              f"its LC {moves.get('lc_win_rate', float('nan')):+.3f}, gold win rate "
              f"{moves.get('gold_win_rate', 0):+.3f}")  # fmt: skip
    head_to_head(results)


def head_to_head(results: dict[int, dict[str, Any]]) -> None:
    """The last policy judged against the selected one, and whether the proxy's LC win rate
    sides with gold where its raw one does not."""
    sided = []
    for seed, result in results.items():
        h = result.get("last_vs_selected")
        if not h:
            return
        print(
            f"seed {seed}, the last policy against the selected one: proxy win rate "
            f"{h['win_rate']:.3f} (LC {h['lc_win_rate']:.3f}), gold win rate "
            f"{h['gold_win_rate']:.3f} (LC {h['gold_lc_win_rate']:.3f}), length ratio "
            f"{h['length_ratio']:.2f}"
        )
        sided.append(h["gold_win_rate"] < 0.5 < h["win_rate"] and h["lc_win_rate"] < 0.5)
    print(
        "target: the LC win rate moves with gold when the raw one does not (gold prefers the "
        "selected policy, the proxy's raw win rate the last, its LC win rate the selected): "
        f"{'met' if all(sided) else 'NOT met'} ({sum(sided)} of {len(sided)} seeds)"
    )
