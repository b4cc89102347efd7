"""The promotion gate: bless the aligned policy only when it wins and stays close to its reference.

Checks, each reported as one line with its figure and threshold:

- the win rate's lower interval bound > ``min_win_rate_lower``, strictly. The win rate is the
  gold reward's whenever the summary has one: the reward model is what the policy was trained
  to please, so its win rate rewards exploiting it as much as improving. Without a gold
  reward it is the reward model's (the judge's);
- KL(aligned ‖ reference) per response token ≤ ``max_kl``;
- KL(aligned ‖ anchor) per response token ≤ ``max_anchor_kl`` (when the summary has an
  anchor part: drift across runs from the first promoted policy);
- every figure in the summary is finite (a NaN means a broken measure, not a pass);
- over-optimisation (the summary's ``overoptimisation`` part, overoptimisation.py): the
  aligned policy's mean response length ≤ ``max_length_ratio`` times the reference's; with
  a held-out reward model, its gain > ``min_heldout_gain`` and the judge's gain minus it
  ≤ ``max_reward_gap``; with a reward ensemble, its spread on the aligned samples ≤
  ``max_disagreement`` times its spread on the reference's. Each line names its judge.

The win rate must beat its threshold. It is the win rate of independent draws (each
aligned sample against the reference's draws of other keys), so an unchanged policy wins
0.5 in expectation and, with ``min_win_rate_lower=0.5``, passes by chance only as often as
its interval misses low: (1 − confidence) / 2, 2.5% at 95%. (The same-key pairing it
replaced tied an unchanged policy everywhere, 0.5 [0.5, 0.5], which no judge's resolution
explains.) The KL threshold is the worst value still acceptable,
so a KL exactly at ``max_kl`` passes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

from components.evaluate.config import EvalConfig
from components.evaluate.measures import JUDGE_GOLD, JUDGE_REWARD_MODEL


@dataclasses.dataclass(frozen=True, slots=True)
class Gate:
    """The verdict and one line per check that led to it."""

    blessed: bool
    reasons: list[str]
    judge: str = JUDGE_REWARD_MODEL  # whose win rate decided: JUDGE_GOLD or JUDGE_REWARD_MODEL


def _show(value: float, threshold: float) -> tuple[str, str]:
    """Both numbers with the fewest decimals (2 to 6) that keep unequal ones apart on screen."""
    for decimals in range(2, 7):
        shown = f"{value:.{decimals}f}", f"{threshold:.{decimals}f}"
        if shown[0] != shown[1] or value == threshold:
            return shown
    return f"{value!r}", f"{threshold!r}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(
    label: str, value: Any, threshold: float, *, above: bool, unit: str = ""
) -> tuple[bool, str]:
    """Whether ``value`` is strictly above (``above``) or at most ``threshold``, said in a line."""
    if not _is_number(value) or not math.isfinite(value):
        return False, f"{label} is {value!r}, not a finite number: fail"
    passed = value > threshold if above else value <= threshold
    shown, limit = _show(float(value), float(threshold))
    sign = (">" if passed else "≤") if above else ("≤" if passed else ">")
    return passed, f"{label} {shown}{unit} {sign} {limit}{unit}: {'pass' if passed else 'fail'}"


def _numbers(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every number in a nested dict/list with its dotted path."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _numbers(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _numbers(value, f"{path}[{i}]")
    elif _is_number(tree):
        yield path, tree


def _lookup(summary: Mapping[str, Any], *keys: str) -> Any:
    """``summary[k1][k2]...``, or None where a level is missing."""
    node: Any = summary
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _win_rate_rule(summary: Mapping[str, Any]) -> tuple[str, Any, str]:
    """(judge, the win rate's lower bound, its label): gold's when measured, else the judge's."""
    if summary.get("gold") is not None:
        low = _lookup(summary, "gold", "win_rate", "low")
        return JUDGE_GOLD, low, "win-rate lower bound (judged by the gold reward)"
    if summary.get("judge") == JUDGE_GOLD:
        low = _lookup(summary, "win_rate", "low")
        return JUDGE_GOLD, low, "win-rate lower bound (judged by the gold reward)"
    return JUDGE_REWARD_MODEL, _lookup(summary, "win_rate", "low"), "win-rate lower bound"


def decide(summary: Mapping[str, Any], config: EvalConfig) -> Gate:
    """Bless iff win-rate lower bound (gold's when measured) > min_win_rate_lower, KL ≤ max_kl,
    KL to the anchor ≤ max_anchor_kl and all figures finite."""
    judge, win_low, label = _win_rate_rule(summary)
    kl = _lookup(summary, "kl", "per_token")
    checks = [
        _check(label, win_low, config.min_win_rate_lower, above=True),
        _check("KL", kl, config.max_kl, above=False, unit=" nats/token"),
    ]
    if summary.get("anchor") is not None:
        anchor_kl = _lookup(summary, "anchor", "kl", "per_token")
        checks.append(
            _check("KL to the anchor", anchor_kl, config.max_anchor_kl, above=False,
                   unit=" nats/token")
        )  # fmt: skip
    checks += _overoptimisation_checks(summary.get("overoptimisation"), config)
    broken = [path for path, value in _numbers(summary) if not math.isfinite(value)]
    if broken:
        checks.append((False, f"non-finite figures in the summary ({', '.join(broken)}): fail"))
    else:
        checks.append((True, "every figure in the summary is finite: pass"))
    return Gate(
        blessed=all(ok for ok, _ in checks), reasons=[reason for _, reason in checks], judge=judge
    )


def _overoptimisation_checks(
    part: Mapping[str, Any] | None, config: EvalConfig
) -> list[tuple[bool, str]]:
    """The over-optimisation rules whose figures the summary has (gate docstring)."""
    if not part:
        return []
    checks = []
    # Always measured (a None: the reference's responses were empty), so never skipped.
    if "length_ratio" in part and math.isfinite(config.max_length_ratio):
        checks.append(
            _check("response length over the reference's", part["length_ratio"],
                   config.max_length_ratio, above=False, unit="x")
        )  # fmt: skip
    if part.get("heldout_gain") is not None:
        if math.isfinite(config.min_heldout_gain):
            gain = _lookup(part, "heldout_gain", "difference", "value")
            checks.append(
                _check("reward gain judged by the held-out reward model", gain,
                       config.min_heldout_gain, above=True, unit=" std")
            )  # fmt: skip
        if math.isfinite(config.max_reward_gap):
            checks.append(
                _check("judge's gain minus the held-out reward model's", part.get("gap"),
                       config.max_reward_gap, above=False, unit=" std")
            )  # fmt: skip
    ratio = _lookup(part, "disagreement", "ratio")
    if part.get("disagreement") is not None and math.isfinite(config.max_disagreement):
        checks.append(
            _check("reward-ensemble spread over the reference's", ratio,
                   config.max_disagreement, above=False, unit="x")
        )  # fmt: skip
    return checks
