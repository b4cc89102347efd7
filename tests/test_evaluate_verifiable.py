"""The evaluate stage's verifiable mode on the built-in reasoning task (8 CPU devices): the SFT
policy against itself gains exactly nothing and is not blessed; a policy GRPO taught to answer
wrongly loses accuracy and the gate refuses it, naming its judge; the files; the greedy-only
mode; the gate's arithmetic and the config's checks."""

from __future__ import annotations

import json
import math

import pytest

from components.evaluate import outputs, report, verifiable_report
from components.evaluate.config import EvalConfig
from components.evaluate.stage import run as evaluate
from components.evaluate.verifiable_report import decide
from components.ppo import PPOConfig
from components.ppo import run as train
from tests import verifiable_task

pytestmark = pytest.mark.slow

# The verifier turned around: 1 for a tagged answer that is wrong. GRPO learns to answer
# wrongly within 40 iterations, on the eval problems too.
ALWAYS_WRONG = """
import re


def wrong(prompts, completions, answer, **kwargs):
    found = [re.fullmatch(r"<answer> (\\d+) </answer>", c.strip()) for c in completions]
    return [float(m is not None and m.group(1) != a) for m, a in zip(found, answer)]
"""
GRPO = dict(
    algorithm="grpo", group_size=8, rollout_batch_size=128, minibatches=2, max_new_tokens=6,
    missing_eos_penalty=0.0, save_every=1000, adaptive_kl=False, kl_coef=0.0, kl_stop=50.0,
    iterations=40, learning_rate=3e-4,
)  # fmt: skip
EVAL = dict(max_new_tokens=6, bootstrap_samples=200, report_to="none")
VERIFIER = "builtin/exact-match"


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, str]:
    """The task's shards and SFT policy, and a policy trained to answer wrongly (``wrong``),
    whose training log holds the exact-match curve too (weight 0: logged, not rewarded)."""
    root = tmp_path_factory.mktemp("verifiable_eval")
    paths = verifiable_task.build(root)
    (root / "always_wrong.py").write_text(ALWAYS_WRONG)
    paths["functions"] = f"{VERIFIER},{root / 'always_wrong.py'}:wrong"
    paths["wrong"] = str(root / "wrong")
    config = PPOConfig(**GRPO, reward_functions=paths["functions"], reward_weights="0,1")
    train(config, paths["prompts"], paths["sft"], "", paths["wrong"])
    return paths


@pytest.fixture(scope="module")
def unchanged(task, tmp_path_factory) -> tuple[dict, str]:
    output = str(tmp_path_factory.mktemp("unchanged"))
    config = EvalConfig(**EVAL, reward_functions=VERIFIER)
    return evaluate(config, task["prompts"], task["sft"], task["sft"], "", output), output


@pytest.fixture(scope="module")
def worse(task, tmp_path_factory) -> tuple[dict, str]:
    """The wrong-answering policy against the SFT one; a reward model folder given is
    ignored."""
    output = str(tmp_path_factory.mktemp("worse"))
    config = EvalConfig(**EVAL, reward_functions=task["functions"])
    no_reward_model = str(tmp_path_factory.getbasetemp() / "no-such-reward-model")
    return (
        evaluate(config, task["prompts"], task["wrong"], task["sft"], no_reward_model, output),
        output,
    )


def test_the_sft_policy_against_itself_gains_exactly_nothing(unchanged) -> None:
    result, _ = unchanged
    assert result["kind"] == "verifiable" and result["judge"] == "reward function exact_match"
    assert result["accuracy_gain"] == {"value": 0.0, "interval": [0.0, 0.0]}
    assert not result["blessed"]
    assert 0.0 < result["accuracy"] < 1.0
    assert result["reference"]["accuracy"] == result["accuracy"]
    assert result["prompts"] == 54 and result["samples_per_prompt"] == 8  # a quarter of 200
    assert list(result["pass_at_k"]) == ["1", "2", "4", "8"]
    values = [estimate["value"] for estimate in result["pass_at_k"].values()]
    assert values == sorted(values) and 0.0 < values[0] < values[-1] <= 1.0
    for estimate in result["pass_at_k"].values():
        low, high = estimate["interval"]
        assert low <= estimate["value"] <= high
    # The same parameters recomputed by one forward pass: not a rounding error of KL.
    assert result["kl"] == {"per_token": 0.0, "per_sequence": 0.0, "estimator": "k3"}
    means = result["reward_functions"]["exact_match"]
    assert means["policy"] == means["reference"] == result["accuracy"]
    assert result["ended_fraction"] == 1.0 and result["mean_response_length"] == 4.0


def test_a_policy_that_answers_wrongly_loses_accuracy_and_is_refused(worse) -> None:
    result, output = worse
    rows = [json.loads(line) for line in open(f"{output}/samples.jsonl")]
    correct = sum(row["policy_correct"] for row in rows)
    assert correct == round(result["accuracy"] * len(rows))
    assert result["accuracy"] < 0.1 < 0.2 < result["reference"]["accuracy"]
    gain = result["accuracy_gain"]
    assert gain["value"] == pytest.approx(result["accuracy"] - result["reference"]["accuracy"])
    assert gain["interval"][1] < 0.0
    assert not result["blessed"]
    means = result["reward_functions"]
    assert means["wrong"]["policy"] > 0.8 > means["wrong"]["reference"]
    assert means["exact_match"]["policy"] == result["accuracy"]
    assert result["kl"]["per_token"] > 0.0
    record = json.loads(open(f"{output}/eval.json").read())
    assert record["gate_judge"] == "reward function exact_match"
    assert "judged by reward function exact_match" in record["reasons"][0]
    assert f"{result['accuracy']:.4f} against the reference's" in record["reasons"][0]
    assert record["reasons"][-1].endswith("min_accuracy_gain +0.0000: fail")


def test_the_files_hold_the_figures(worse) -> None:
    result, output = worse
    record = json.loads(open(f"{output}/eval.json").read())
    assert {"schema_version", "blessed", "reasons", "gate_judge", "summary"} <= set(record)
    assert record["blessed"] is False and record["summary"]["kind"] == "verifiable"
    metrics = json.loads(open(f"{output}/metrics.json").read())
    expected = {
        "accuracy": result["accuracy"],
        "accuracy_gain": result["accuracy_gain"]["value"],
        "accuracy_gain_low": result["accuracy_gain"]["interval"][0],
        "reference_accuracy": result["reference"]["accuracy"],
        "pass_at_8": result["pass_at_k"]["8"]["value"],
        "mean_response_length": result["mean_response_length"],
        "ended_fraction": result["ended_fraction"],
        "blessed": 0.0,
    }
    assert {name: metrics[name] for name in expected} == expected
    rows = [json.loads(line) for line in open(f"{output}/samples.jsonl")]
    assert len(rows) == result["prompts"]
    assert sum(row["reference_correct"] for row in rows) == round(
        result["prompts"] * result["reference"]["accuracy"]
    )
    first = rows[0]
    assert set(first["columns"]) == {"answer"} and first["prompt"].startswith("What is")
    assert (
        first["policy_response"].startswith("<answer>") and "</s>" not in first["policy_response"]
    )
    assert 0 <= first["reference_samples_correct"] <= 8
    page = open(f"{output}/report.html").read()
    assert '<table class="accuracy">' in page and 'data-key="accuracy_gain.interval.0"' in page
    assert 'data-key="reference.pass_at_k.8.value"' in page
    assert "<img" in page and "exact_match" in page and 'data-blessed="false"' in page


def test_greedy_only_and_a_policy_without_reward_curves(task, tmp_path) -> None:
    config = EvalConfig(**EVAL, reward_functions=VERIFIER, pass_samples=0, max_eval_prompts=8)
    result = evaluate(config, task["prompts"], task["sft"], task["sft"], "", str(tmp_path))
    assert result["prompts"] == 8 and result["samples_per_prompt"] == 0
    assert result["pass_at_k"] == {} and result["reference"]["pass_at_k"] == {}
    assert result["kl"] == {"per_token": 0.0, "per_sequence": 0.0, "estimator": "k1"}
    page = (tmp_path / "report.html").read_text()
    assert "no reward-function metrics in the policy" in page and "<img" not in page
    assert all(row["policy_samples_correct"] is None for row in map(
        json.loads, (tmp_path / "samples.jsonl").read_text().splitlines()))  # fmt: skip


def test_the_file_names_are_the_preference_evaluations() -> None:
    ours = verifiable_report
    assert (ours.REPORT_FILE, ours.EVAL_JSON_FILE) == (report.REPORT_FILE, report.EVAL_JSON_FILE)
    assert ours.METRICS_JSON_FILE == outputs.METRICS_JSON_FILE
    assert ours.SAMPLES_FILE == outputs.SAMPLES_FILE


def _summary(value: float, low: float, high: float) -> dict:
    return {
        "judge": "reward function exact_match", "prompts": 40, "confidence": 0.9,
        "accuracy": 0.5 + value, "reference": {"accuracy": 0.5},
        "accuracy_gain": {"value": value, "interval": [low, high]},
    }  # fmt: skip


def test_the_gate_blesses_only_a_lower_bound_above_the_threshold() -> None:
    gate = decide(_summary(0.2, 0.05, 0.35), 0.0)
    assert gate.blessed and gate.judge == "reward function exact_match"
    assert gate.reasons[0].endswith("gain +0.2000, 90% interval [+0.0500, +0.3500]")
    assert gate.reasons[1] == "accuracy-gain lower bound +0.0500 > min_accuracy_gain +0.0000: pass"
    assert not decide(_summary(0.2, 0.05, 0.35), 0.05).blessed  # strictly above
    refused = decide(_summary(0.2, math.nan, 0.35), -1.0)
    assert not refused.blessed and "not all finite" in refused.reasons[0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(reward_functions="builtin/nope"),
         "reward_functions: reward function 'builtin/nope' is not a built-in one"),
        (dict(reward_functions=VERIFIER, reward_weights="1,2"),
         "reward_weights: 2 weight.s. for 1 reward function"),
        (dict(reward_weights="1"), "reward_weights: '1' weighs no reward function"),
        (dict(pass_samples=-1), "pass_samples: -1 must be >= 0"),
        (dict(reward_functions=VERIFIER, greedy=True),
         "pass_samples: 8 samples per prompt need greedy=False"),
        (dict(min_accuracy_gain=1.0), r"min_accuracy_gain: 1.0 must be in \[-1, 1\)"),
        (dict(min_accuracy_gain=math.nan), "min_accuracy_gain: nan must be a finite number"),
    ],
)  # fmt: skip
def test_the_config_names_what_is_wrong(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalConfig(**fields)


def test_the_config_takes_user_functions_unloaded_and_greedy_without_samples() -> None:
    config = EvalConfig(reward_functions=f"{VERIFIER},no_such_file.py:f", reward_weights="1,0.5",
                        greedy=True, pass_samples=0)  # fmt: skip
    assert config.pass_samples == 0
    assert EvalConfig(greedy=True).pass_samples == 8  # unused without reward functions
