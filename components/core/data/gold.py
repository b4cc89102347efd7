"""Gold rewards by spec: a built-in name, ``PATH.py:FUNCTION`` or ``MODULE:FUNCTION``.

A gold reward is a function ``(prompt: str, response: str) -> float`` that says what a
response is really worth (as opposed to what the learned reward model thinks). The spec
names one of:

- a built-in reward (``builtin_task``'s registry, e.g. ``builtin/sentiment-v1``);
- ``PATH.py:FUNCTION``: a function in a Python file (local or ``gs://``), run as a module;
- ``MODULE:FUNCTION``: a function in an importable module (``my_pkg.rewards:score``).

The resolved function checks every score: a non-number or a non-finite value raises a
ValueError naming the spec, the prompt and the response, so a broken gold reward never
turns into a NaN figure three stages later.

``policy_gold_scores`` measures a policy with one: its samples on the unique eval prompts
(core.model.eval_sampling: per-(prompt, sample) keys, so two policies sampled with one seed share
them), each scored by the gold reward.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from components.core import fileio, function_specs
from components.core.data import builtin_task

GoldReward = Callable[[str, str], float]
PyTree = Any
_SHOWN_CHARS = 200  # of a prompt or response quoted in an error


def _short(text: str) -> str:
    """``text`` quoted, cut to a readable length."""
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…")


GOLD = function_specs.FunctionKind(
    what="gold reward",
    signature="(prompt: str, response: str) -> float",
    module_prefix="alignpipe_gold",
)


def _load(spec: str) -> GoldReward:
    """The unchecked function that ``spec`` names."""
    if spec in builtin_task.gold_reward_names():
        return builtin_task.gold_reward_fn(spec)
    if ":" not in spec:
        raise ValueError(
            f"gold reward {spec!r} is not a built-in one "
            f"({', '.join(builtin_task.gold_reward_names())}); pass one of those, "
            "PATH.py:FUNCTION or MODULE:FUNCTION"
        )
    kind = dataclasses.replace(GOLD, builtins=tuple(builtin_task.gold_reward_names()))
    return function_specs.load_function(spec, kind)


def _checked(spec: str, function: GoldReward) -> GoldReward:
    """``function`` with every score checked to be a finite number, returned as float."""

    @functools.wraps(function)
    def score(prompt: str, response: str) -> float:
        where = f"gold reward {spec!r} on prompt {_short(prompt)} and response {_short(response)}"
        try:
            value = function(prompt, response)
        except Exception as error:
            raise ValueError(f"{where} raised {type(error).__name__}: {error}") from error
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{where} returned {value!r}, not a number; return a float")
        if not float("-inf") < float(value) < float("inf"):
            raise ValueError(f"{where} returned {value!r}; return a finite float")
        return float(value)

    return score


def resolve_gold_reward(spec: str) -> GoldReward:
    """The gold reward ``spec`` names, checking each score (see the module docstring)."""
    return _checked(spec, _load(spec))


def validate_gold_reward(spec: str) -> None:
    """Raise ValueError when ``spec`` names no loadable gold reward ('' names none: fine)."""
    if spec:
        _load(spec)


def is_builtin(spec: str) -> bool:
    """Whether ``spec`` names a built-in gold reward (safe to take from a data manifest)."""
    return spec in builtin_task.gold_reward_names()


def policy_gold_scores(
    graphdef: Any,
    params: PyTree,
    shards_dir: str,
    spec: str,
    *,
    prompt_len: int,
    max_new_tokens: int,
    temperature: float,
    samples_per_prompt: int,
    seed: int,
    prompt_set: dict[str, Any] | None = None,
) -> np.ndarray:
    """Gold scores [P, S] of ``samples_per_prompt`` samples of the policy (``params`` placed on
    the devices: ``parallel.place``) on every unique eval prompt of ``shards_dir`` (or on
    the prompts ``eval_sampling.split_prompts(**prompt_set)`` picks: split and hold-out)."""
    # Sampling needs JAX and the input pipeline: imported here, so the configs that
    # validate a spec import this module lightly.
    from components.core.data.tokenizers import load_tokenizer
    from components.core.model import eval_sampling

    gold = resolve_gold_reward(spec)
    tokenizer = load_tokenizer(fileio.join(shards_dir, "tokenizer"))
    prompts = eval_sampling.split_prompts(
        shards_dir, prompt_len=prompt_len, **(prompt_set or {"split": "eval"})
    )
    settings = eval_sampling.SamplingSettings(
        max_new_tokens, tokenizer.stop_ids, tokenizer.pad_id, temperature, tokenizer.vocab_size
    )
    responses = eval_sampling.sample_responses(
        graphdef, params, prompts, settings=settings, samples_per_prompt=samples_per_prompt,
        seed=seed, batch_size=len(prompts.tokens) * samples_per_prompt,
    )  # fmt: skip
    scores = np.zeros((len(prompts.tokens), samples_per_prompt))
    for p, (prompt, prompt_mask) in enumerate(zip(prompts.tokens, prompts.mask, strict=True)):
        prompt_text = tokenizer.decode(prompt[prompt_mask])
        for s, (response, mask) in enumerate(
            zip(responses.tokens[p], responses.mask[p], strict=True)
        ):
            scores[p, s] = gold(prompt_text, tokenizer.decode(response[mask.astype(bool)]))
    return scores
