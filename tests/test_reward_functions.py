"""Reward functions (TRL's reward_funcs): the built-ins, loading by spec with weights, batch
scoring with None (not judged), TRL's weighted nansum and its metric names, and every way a
function can be wrong failing with its name, one offending prompt and the traceback; the same
in a spawned process pool, with its per-call timeout."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from components.core.rewards import builtin
from components.core.rewards.functions import load_reward_functions
from components.core.rewards.scoring import RewardFunctionError, RewardScorer, weighted_total
from components.ppo.rollout import function_stats

USER_FUNCTIONS = """
import time


def starts_with_yes(prompts, completions, **kwargs):
    return [1.0 if c.startswith("yes") else 0.0 for c in completions]


def only_math(prompts, completions, task, **kwargs):
    # TRL's multi-task convention: None where this function does not judge.
    return [float(len(c)) if t == "math" else None for c, t in zip(completions, task)]


def broken_on_b(prompts, completions, **kwargs):
    return [1.0 / (0 if c == "b" else 1) for c in completions]


def too_few(prompts, completions, **kwargs):
    return [1.0]


def nan_on_second(prompts, completions, **kwargs):
    return [1.0, float("nan")] + [0.0] * (len(completions) - 2)


def says_text(prompts, completions, **kwargs):
    return ["high"] * len(completions)


def slow(prompts, completions, **kwargs):
    time.sleep(30)
    return [0.0] * len(completions)
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(USER_FUNCTIONS)
    return str(path)


def test_exact_match_reads_tags_boxes_and_numbers():
    completions = [
        "so <answer> 42 </answer>",
        "thus \\boxed{\\frac{1}{2}} and \\boxed{1,200}",
        "first 3 then 12.0",
        [{"role": "assistant", "content": "<answer>Paris</answer>"}],  # conversational
        "no number here",
        "7",
    ]
    answers = ["42", "1200", "12", "paris", "5", None]
    assert builtin.exact_match([""] * 6, completions, answer=answers) == [
        1.0, 1.0, 1.0, 1.0, 0.0, None,
    ]  # fmt: skip
    assert builtin.extract_answer("\\boxed{a{b}c} end") == "a{b}c"
    assert builtin.exact_match(["p"], ["1"]) == [None]  # no answer column: not judged


def test_exact_match_reads_references_as_gsm8k_and_math_write_them():
    """openai/gsm8k's answer column is a worked solution ending '#### 72'; a MATH
    solution boxes its answer; TRL's accuracy_reward reads a solution column."""
    gsm8k = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
    )
    completions = ["She sold 72 clips.", "24", "#### 1,200", "\\boxed{\\frac{1}{2}}", "x = 3"]
    answers = [gsm8k, gsm8k, "step 1\n#### 1200", None, None]
    solutions = [None, None, None, "So $x=\\boxed{\\frac{1}{2}}$.", None]
    got = builtin.exact_match([""] * 5, completions, answer=answers, solution=solutions)
    assert got == [1.0, 0.0, 1.0, 1.0, None]
    assert builtin.exact_match(["p"], ["so 3"], solution=["\\boxed{3}"]) == [1.0]
    assert builtin.reference_answer("  Paris ") == "Paris"
    # A markdown heading is not GSM8K's final line; blank and NaN references are missing.
    heading = "#### Step 1: add\n2+3=5\n#### Conclusion\nThe answer is $\\boxed{5}$."
    assert builtin.reference_answer(heading) == "5"
    got = builtin.exact_match(
        [""] * 3, ["5", "5", "5"], answer=["", float("nan"), "  "],
        solution=["\\boxed{5}", "\\boxed{5}", None],
    )  # fmt: skip
    assert got == [1.0, 1.0, None]


def test_think_format_and_dapos_length_penalty():
    assert builtin.think_format(
        [
            "<think>add 2 and 2</think> 4",
            "<think>x</think>",
            "4",
            "<think>a</think><think>b</think> 4",
        ]
    ) == [1.0, 0.0, 0.0, 0.0]
    # TRL's get_soft_overlong_punishment(100, 20) docstring example: 90 tokens -> -0.5.
    ids = [[1] * 80, [1] * 90, [1] * 100, [1] * 120]
    assert builtin.length_penalty(["x"] * 4, completion_ids=ids, max_completion_length=100) == [
        0.0, -0.5, -1.0, -1.0,
    ]  # fmt: skip


def test_specs_weights_and_names(user_file):
    functions = load_reward_functions(
        f"builtin/exact-match, {user_file}:starts_with_yes, "
        "components.core.rewards.builtin:think_format",
        "1, 0.5, 2",
    )
    assert [(f.name, f.weight) for f in functions] == [
        ("exact_match", 1.0), ("starts_with_yes", 0.5), ("think_format", 2.0),
    ]  # fmt: skip
    for specs, weights, message in [
        ("builtin/exact", "", r"not a built-in one \(builtin/exact-match"),
        (f"{user_file}:nope", "", r"has no function 'nope'; define nope\(prompts, completions"),
        ("/no/such.py:f", "", "file /no/such.py does not exist"),
        ("builtin/exact-match", "1,2", r"2 weight\(s\) for 1 reward function"),
        ("builtin/exact-match", "x", "not a comma-separated list of numbers"),
        ("builtin/exact-match,builtin/exact-match", "", "are both named 'exact_match'"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_reward_functions(specs, weights)


def test_weighted_nansum_none_and_metrics(user_file):
    functions = load_reward_functions(f"{user_file}:starts_with_yes,{user_file}:only_math", "2,0.5")
    with RewardScorer(functions) as scorer:
        batch = scorer.score(
            ["p1", "p2", "p3"], ["yes!", "no", "yes"], {"task": ["math", "chat", "poem"]}
        )
    np.testing.assert_array_equal(batch.per_function[:, 0], [1.0, 0.0, 1.0])
    assert batch.per_function[0, 1] == 4.0 and np.isnan(batch.per_function[1:, 1]).all()
    # TRL: sum of weight x reward over the functions that judged (nansum).
    np.testing.assert_allclose(batch.total, [2 * 1 + 0.5 * 4, 0.0, 2.0])
    assert batch.weights == (2.0, 0.5) and batch.seconds >= 0


def test_a_completion_no_function_judged_is_unscorable(user_file):
    functions = load_reward_functions(f"{user_file}:only_math")
    batch = RewardScorer(functions).score(["a", "b"], ["xx", "yyy"], {"task": ["chat", "math"]})
    assert np.isnan(batch.total[0]) and batch.total[1] == 3.0


def test_the_figures_over_every_device_are_trls():
    """rewards/<name>/mean and /std over the completions each function judged (std
    Bessel-corrected, as TRL's nanstd), the total's mean over the judged ones and the share
    none judged: over 8 devices, as numpy computes them over all 16 rows at once."""
    rng = np.random.default_rng(0)
    per_function = rng.normal(size=(16, 2)).astype(np.float32)
    per_function[rng.random((16, 2)) < 0.3] = np.nan
    per_function[3] = np.nan  # judged by none
    total = weighted_total(per_function, (1.0, 2.0))
    stats = jax.pmap(function_stats, axis_name="data")(
        per_function.reshape(8, 2, 2), total.reshape(8, 2).astype(np.float32)
    )
    for i in range(2):
        column = per_function[:, i][~np.isnan(per_function[:, i])]
        assert stats["means"][0, i] == pytest.approx(column.mean(), rel=1e-5)
        assert stats["stds"][0, i] == pytest.approx(column.std(ddof=1), rel=1e-4)
    assert stats["reward"][0] == pytest.approx(np.nanmean(total), rel=1e-5)
    assert stats["unscorable_fraction"][0] == pytest.approx(np.isnan(total).mean())


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("broken_on_b", r"(?s)'broken_on_b' .* raised on prompt 'p1'; fix the function\. Its "
         r"traceback:\n.*ZeroDivisionError"),
        ("too_few", r"'too_few' .* returned 1 rewards for 3 completions, on prompt 'p0'"),
        ("nan_on_second", r"'nan_on_second' .* returned nan, on prompt 'p1' and completion 'b'"),
        ("says_text", r"'says_text' .* returned 'high' \(a str\), not a number, on prompt 'p0'"),
    ],
)  # fmt: skip
def test_what_a_function_gets_wrong_names_it_and_a_prompt(user_file, name, message):
    scorer = RewardScorer(load_reward_functions(f"{user_file}:{name}"))
    with pytest.raises(RewardFunctionError, match=message) as error:
        scorer.score(["p0", "p1", "p2"], ["a", "b", "c"])
    assert "(it must return one finite float" in str(error.value) or "traceback" in str(error.value)


def test_a_process_pool_scores_alike_and_times_out(user_file):
    functions = load_reward_functions(f"builtin/exact-match,{user_file}:starts_with_yes", "1,3")
    prompts = [f"q{i}" for i in range(7)]
    completions = ["yes <answer>3</answer>", "no 4"] * 3 + ["yes"]
    answers = ["3", "4", "5", "4", "3", "1", None]
    with RewardScorer(functions) as local, RewardScorer(functions, workers=2) as pool:
        expected = local.score(prompts, completions, {"answer": answers})
        got = pool.score(prompts, completions, {"answer": answers})
    np.testing.assert_array_equal(got.per_function, expected.per_function)
    np.testing.assert_array_equal(got.total, expected.total)

    with RewardScorer(load_reward_functions(f"{user_file}:broken_on_b"), workers=2) as pool:
        with pytest.raises(
            RewardFunctionError, match=r"(?s)raised on prompt 'p1'.*ZeroDivisionError"
        ):
            pool.score(["p0", "p1"], ["a", "b"])
    scorer = RewardScorer(load_reward_functions(f"{user_file}:slow"), workers=1, timeout=3)
    started = time.monotonic()
    with pytest.raises(
        RewardFunctionError,
        match=r"'slow' .* took longer than 3 s on 2 "
        r"completion\(s\), from prompt 'p0'; make it faster or raise reward_timeout",
    ):
        scorer.score(["p0", "p1"], ["a", "b"])
    assert time.monotonic() - started < 20  # the stuck worker was stopped, not waited for
    scorer.close()
