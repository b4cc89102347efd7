"""The promotion gate at, below and above each threshold, and on broken summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest

from components.evaluate import measures
from components.evaluate.config import EvalConfig
from components.evaluate.gate import decide

CONFIG = EvalConfig(min_win_rate_lower=0.5, max_kl=0.5)


def summary(win_low: float = 0.62, kl: float = 0.1) -> dict:
    """The parts of a summary the gate reads, plus a figure it only checks for finiteness."""
    return {
        "win_rate": {"value": 0.7, "low": win_low, "high": 0.8},
        "kl": {"per_token": kl, "per_sequence": kl * 10},
        "reward": {"aligned": {"mean": 1.0}},
        "gold": None,
    }


@pytest.mark.parametrize(
    "win_low, blessed, reason",
    [
        (0.5, False, "win-rate lower bound 0.50 ≤ 0.50: fail"),  # must beat it, strictly
        (0.49, False, "win-rate lower bound 0.49 ≤ 0.50: fail"),
        (0.62, True, "win-rate lower bound 0.62 > 0.50: pass"),
    ],
)
def test_win_rate_threshold(win_low: float, blessed: bool, reason: str) -> None:
    gate = decide(summary(win_low=win_low), CONFIG)
    assert gate.blessed is blessed
    assert gate.reasons[0] == reason


@pytest.mark.parametrize(
    "kl, blessed, reason",
    [
        (0.5, True, "KL 0.50 nats/token ≤ 0.50 nats/token: pass"),
        (0.51, False, "KL 0.51 nats/token > 0.50 nats/token: fail"),
        (0.12, True, "KL 0.12 nats/token ≤ 0.50 nats/token: pass"),
    ],
)
def test_kl_threshold(kl: float, blessed: bool, reason: str) -> None:
    gate = decide(summary(kl=kl), CONFIG)
    assert gate.blessed is blessed
    assert gate.reasons[1] == reason


def test_both_checks_and_finiteness_are_reported() -> None:
    gate = decide(summary(win_low=0.3, kl=0.9), CONFIG)
    assert not gate.blessed
    assert [r.rsplit(": ", 1)[1] for r in gate.reasons] == ["fail", "fail", "pass"]


def test_figures_near_a_threshold_show_enough_decimals() -> None:
    gate = decide(summary(win_low=0.4999), CONFIG)
    assert gate.reasons[0] == "win-rate lower bound 0.4999 ≤ 0.5000: fail"
    gate = decide(summary(win_low=0.5001), CONFIG)
    assert gate.blessed and gate.reasons[0] == "win-rate lower bound 0.5001 > 0.5000: pass"


def test_the_reason_names_the_gold_reward_when_it_judged() -> None:
    judged = {**summary(win_low=0.62), "judge": "gold"}
    gate = decide(judged, CONFIG)
    assert gate.blessed and gate.judge == "gold"
    assert gate.reasons[0] == "win-rate lower bound (judged by the gold reward) 0.62 > 0.50: pass"
    assert decide({**summary(), "judge": "reward_model"}, CONFIG).reasons == (
        decide(summary(), CONFIG).reasons
    )


def test_the_gold_win_rate_decides_when_there_is_one() -> None:
    """A policy that pleases the reward model (0.62) without beating the reference on gold
    (0.48) is not blessed; the reverse is."""
    gold = {"name": "builtin/sentiment-v1", "win_rate": {"value": 0.55, "low": 0.48}}
    gate = decide({**summary(win_low=0.62), "gold": gold}, CONFIG)
    assert not gate.blessed and gate.judge == "gold"
    assert gate.reasons[0] == "win-rate lower bound (judged by the gold reward) 0.48 ≤ 0.50: fail"
    better = {**gold, "win_rate": {"value": 0.6, "low": 0.53}}
    gate = decide({**summary(win_low=0.45), "gold": better}, CONFIG)
    assert gate.blessed and gate.reasons[0].endswith("0.53 > 0.50: pass")
    assert decide(summary(), CONFIG).judge == "reward_model"


def test_an_unchanged_policy_is_not_blessed() -> None:
    """Identical policies tie every comparison: win rate 0.5 [0.5, 0.5], KL 0."""
    ties = np.zeros((40, 4))
    mask = np.ones((40, 4, 3))
    outputs = measures.PolicyOutputs(rewards=ties, response_mask=mask, ended_with_eos=[1])
    logp = np.full((40, 4, 3), -1.0)
    summ = measures.summarize(
        outputs, outputs, aligned_logprobs=logp, reference_logprobs=logp, config=CONFIG
    )
    assert (summ["win_rate"]["value"], summ["win_rate"]["low"]) == (0.5, 0.5)
    gate = decide(summ, CONFIG)
    assert not gate.blessed
    assert gate.reasons[:2] == [
        "win-rate lower bound 0.50 ≤ 0.50: fail",
        "KL 0.00 nats/token ≤ 0.50 nats/token: pass",
    ]


def test_a_negative_kl_estimate_passes_and_inf_disables_the_check() -> None:
    assert decide(summary(kl=-0.01), CONFIG).blessed  # k1 can dip below 0 on few samples
    assert decide(summary(kl=50.0), EvalConfig(max_kl=math.inf)).blessed


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_figures_fail(bad: float) -> None:
    gate = decide(summary(kl=bad), CONFIG)
    assert not gate.blessed
    assert gate.reasons[1].startswith("KL is") and gate.reasons[1].endswith("fail")
    broken = summary()
    broken["reward"]["aligned"]["mean"] = bad
    gate = decide(broken, CONFIG)
    assert not gate.blessed
    assert "reward.aligned.mean" in gate.reasons[2]


def test_missing_measure_fails() -> None:
    gate = decide({"win_rate": {"low": 0.9}}, CONFIG)
    assert not gate.blessed
    assert gate.reasons[1] == "KL is None, not a finite number: fail"


def test_gate_on_a_real_summary() -> None:
    rng = np.random.default_rng(0)
    mask = np.ones((64, 2, 4))
    outputs = [
        measures.PolicyOutputs(
            rewards=rng.normal(mu, 1, (64, 2)), response_mask=mask, ended_with_eos=[1]
        )
        for mu in (1.0, 0.0)
    ]
    logp = np.full((64, 2, 4), -1.0)
    # A log-ratio of 0.7 per token: k3 = e^-0.7 − 1 + 0.7 ≈ 0.197 nats per token.
    summ = measures.summarize(
        *outputs, aligned_logprobs=logp, reference_logprobs=logp - 0.7, config=CONFIG
    )
    assert summ["kl"]["per_token"] == pytest.approx(np.exp(-0.7) - 1 + 0.7)
    assert decide(summ, CONFIG).blessed
    assert not decide(summ, EvalConfig(max_kl=0.1)).blessed


@pytest.mark.parametrize(
    "anchor_kl, blessed, reason",
    [
        (0.8, True, "KL to the anchor 0.80 nats/token ≤ 1.00 nats/token: pass"),
        (1.0, True, "KL to the anchor 1.00 nats/token ≤ 1.00 nats/token: pass"),
        (1.2, False, "KL to the anchor 1.20 nats/token > 1.00 nats/token: fail"),
    ],
)
def test_anchor_kl_threshold(anchor_kl: float, blessed: bool, reason: str) -> None:
    anchored = {**summary(), "anchor": {"kl": {"per_token": anchor_kl}, "past": []}}
    gate = decide(anchored, EvalConfig(max_anchor_kl=1.0))
    assert gate.blessed is blessed
    assert reason in gate.reasons


def test_no_anchor_part_no_anchor_check_and_inf_turns_it_off() -> None:
    assert not any("anchor" in r for r in decide(summary(), CONFIG).reasons)
    far = {**summary(), "anchor": {"kl": {"per_token": 50.0}}}
    assert decide(far, EvalConfig(max_anchor_kl=math.inf)).blessed
    with pytest.raises(ValueError, match="max_anchor_kl"):
        EvalConfig(max_anchor_kl=-1.0)
