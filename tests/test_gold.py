"""Gold rewards by spec (core/gold.py): built-in names, a user's file or module, and each error."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from components.core.data import builtin_task
from components.core.data.gold import is_builtin, resolve_gold_reward, validate_gold_reward
from components.evaluate import measures
from components.evaluate.config import EvalConfig

GOLD = builtin_task.GOLD_REWARD_NAME
USER_GOLD = """
import dataclasses

@dataclasses.dataclass
class Weights:
    per_char: float = 0.5

def length_bonus(prompt, response):
    return Weights().per_char * len(response) - len(prompt) / 100

def returns_text(prompt, response):
    return "high"

def returns_nan(prompt, response):
    return float("nan")

def returns_true(prompt, response):
    return True

def raises(prompt, response):
    raise KeyError("missing word")

NOT_A_FUNCTION = 3
"""


@pytest.fixture()
def gold_file(tmp_path):
    """A user's gold-reward file on disk."""
    path = tmp_path / "my_gold.py"
    path.write_text(USER_GOLD)
    return str(path)


@pytest.fixture()
def gold_module(tmp_path, monkeypatch):
    """The same functions as an importable module, ``user_gold_mod``."""
    (tmp_path / "user_gold_mod.py").write_text(USER_GOLD)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_gold_mod"
    sys.modules.pop("user_gold_mod", None)


def test_builtin_name_resolves_to_the_task_reward() -> None:
    score = resolve_gold_reward(GOLD)
    assert score("Tell me about the river.", "good great river.") == pytest.approx(2 / 3)
    assert score("Describe the lake.", "") == -1.0
    assert is_builtin(GOLD) and not is_builtin("my_gold.py:length_bonus")
    assert builtin_task.gold_reward_fn(GOLD) is builtin_task.gold_reward  # still works


def test_a_file_function_scores(gold_file) -> None:
    score = resolve_gold_reward(f"{gold_file}:length_bonus")
    assert score("p" * 50, "abcd") == pytest.approx(0.5 * 4 - 0.5)
    assert isinstance(score("", "ab"), float)
    # measures.gold_scores takes the spec too: 0.5 * len - 0 for each response
    scores = measures.gold_scores(f"{gold_file}:length_bonus", ["", ""], ["a", "abc"])
    np.testing.assert_allclose(scores, [0.5, 1.5])


def test_a_module_function_scores(gold_module) -> None:
    score = resolve_gold_reward(f"{gold_module}:length_bonus")
    assert score("", "abcdef") == 3.0
    assert EvalConfig(gold_reward=f"{gold_module}:length_bonus").gold_reward.endswith("bonus")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", r"gold reward 'nope' is not a built-in one \(builtin/sentiment-v1\); pass"),
        ("/no/such/gold.py:score", r"file /no/such/gold.py does not exist; give the path"),
        ("no_such_module_x:score", r"module 'no_such_module_x' does not import .*PYTHONPATH"),
        ("json:no_such_fn", r"module 'json' has no function 'no_such_fn'; define no_such_fn\("),
        ("json:__doc__", r"'__doc__' in module 'json' is a str, not a function"),
        ("json:", r"expected a built-in name .* fix the spec"),
    ],
)
def test_bad_specs_are_clear_value_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_gold_reward(spec)
    with pytest.raises(ValueError, match="gold_reward: gold reward"):
        EvalConfig(gold_reward=spec)


def test_file_errors_name_the_file(gold_file, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"my_gold.py has no function 'absent'"):
        validate_gold_reward(f"{gold_file}:absent")
    with pytest.raises(ValueError, match=r"'NOT_A_FUNCTION' in file .*my_gold.py is a int"):
        validate_gold_reward(f"{gold_file}:NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match=r"running .*broken.py failed with ModuleNotFoundError"):
        validate_gold_reward(f"{broken}:score")
    validate_gold_reward("")  # no gold reward: nothing to check


@pytest.mark.parametrize(
    "function, message",
    [
        ("returns_text", r"returned 'high', not a number; return a float"),
        ("returns_nan", r"returned nan; return a finite float"),
        ("returns_true", r"returned True, not a number"),
        ("raises", r"raised KeyError: 'missing word'"),
    ],
)
def test_bad_scores_name_the_spec_prompt_and_response(gold_file, function, message) -> None:
    spec = f"{gold_file}:{function}"
    score = resolve_gold_reward(spec)
    expected = (
        rf"gold reward '{spec}' on prompt 'Describe the lake.' and response 'calm.' {message}"
    )
    with pytest.raises(ValueError, match=expected):
        score("Describe the lake.", "calm.")


def test_long_texts_are_cut_in_errors(gold_file) -> None:
    score = resolve_gold_reward(f"{gold_file}:returns_nan")
    with pytest.raises(ValueError) as error:
        score("x" * 1000, "y" * 1000)
    assert "x" * 200 + "…" in str(error.value) and "x" * 201 not in str(error.value)


def test_numpy_scores_are_plain_floats(tmp_path) -> None:
    path = tmp_path / "np_gold.py"
    path.write_text("import numpy as np\ndef score(p, r):\n    return np.float32(len(r))\n")
    value = resolve_gold_reward(f"{path}:score")("", "abc")
    assert type(value) is float and value == 3.0 and math.isfinite(value)
