"""The ``README.md`` an export writes: a Hugging Face model card.

YAML front matter as the Hub reads it (``library_name``, ``tags``, and ``base_model`` when the
policy came from a Hub checkpoint whose id is known), then how the policy was trained (the
stage, its algorithm and settings) and, for a promoted version, the run it came from, the
evaluation's figures with their intervals and judge, and the gate's decision, read from the
version's promotion record (``PROMOTED.json``).
"""

from __future__ import annotations

from typing import Any

import yaml

# The training settings a reader looks for first, when the stage has them.
KEY_SETTINGS = (
    "algorithm", "iterations", "steps", "learning_rate", "kl_target", "kl_coef", "beta",
    "loss_type", "group_size", "rollout_batch_size", "batch_size", "max_new_tokens",
    "temperature", "lora_rank", "lora_alpha", "seed",
)  # fmt: skip
# (label, figure key) of the evaluation, each with its interval's keys when it has one.
FIGURES = (
    ("win rate against the reference (reward model)", "win_rate"),
    ("gold-judge win rate", "gold/win_rate"),
    ("reward gain", "reward/difference"),
    ("gold gain", "gold/difference"),
    ("gain over best-of-n at the same KL", "ppo_vs_best_of_n"),
)


def _front_matter(info: dict[str, Any], family: str, promoted: dict[str, Any] | None) -> str:
    hf = info.get("hf") or {}
    algorithm = (promoted or {}).get("algorithm") or info.get("training", {}).get("algorithm")
    tags = ["alignpipe", "rlhf", family, *([algorithm] if algorithm else [])]
    meta: dict[str, Any] = {"library_name": "transformers", "tags": tags}
    if hf.get("hub_id"):
        meta["base_model"] = hf["hub_id"]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _figure(figures: dict[str, float], key: str) -> str | None:
    value = figures.get(f"{key}/value", figures.get(key))
    if value is None:
        return None
    low, high = figures.get(f"{key}/low"), figures.get(f"{key}/high")
    if low is None:
        low, high = figures.get(f"{key}_interval/low"), figures.get(f"{key}_interval/high")
    interval = f" [{low:.3f}, {high:.3f}]" if low is not None and high is not None else ""
    return f"{value:.3f}{interval}"


def _evaluation(promoted: dict[str, Any]) -> list[str]:
    figures = promoted.get("figures", {})
    confidence = figures.get("confidence", 0.95)
    lines = [
        "## Evaluation",
        "",
        f"Against the reference policy on held-out prompts ({int(figures.get('num_prompts', 0))} "
        f"prompts; intervals: {confidence:.0%} bootstrap over prompts).",
        "",
        "| figure | value |",
        "| --- | --- |",
    ]
    for label, key in FIGURES:
        shown = _figure(figures, key)
        if shown is not None:
            lines.append(f"| {label} | {shown} |")
    if "kl/per_token" in figures:
        lines.append(f"| KL to the reference (nats/token) | {figures['kl/per_token']:.4f} |")
    verdict = "promoted (blessed)" if promoted.get("blessed") else "not blessed"
    judge = promoted.get("gate_judge", "the reward model")
    lines += ["", f"Gate: {verdict}; judge: {judge}.", ""]
    lines += [f"- {reason}" for reason in promoted.get("reasons", [])]
    return lines


def model_card(
    info: dict[str, Any], family: str, promoted: dict[str, Any] | None, title: str
) -> str:
    """The card of a policy whose ``config.json`` is ``info``, exported as ``family``;
    ``promoted``: its version's promotion record, when it is a promoted version."""
    training = info.get("training", {})
    settings = [(k, training[k]) for k in KEY_SETTINGS if k in training]
    lines = [
        f"# {title}",
        "",
        f"A {family} policy aligned with alignpipe, exported for "
        "`transformers` (`AutoModelForCausalLM`, `AutoTokenizer`; the chat template and the "
        "stop tokens of `generation_config.json` are the ones it was trained with).",
        "",
        "## Training",
        "",
        f"- stage: {info.get('stage', '?')}, step {info.get('step', '?')}",
    ]
    if info.get("base_policy"):
        lines.append(f"- started from: `{info['base_policy']}`")
    if (info.get("hf") or {}).get("architecture"):
        lines.append(f"- base architecture: {info['hf']['architecture']}")
    lines += [f"- {key}: {value}" for key, value in settings]
    if promoted:
        lines += [
            f"- run: {promoted.get('run_id', '?')}, promoted as version "
            f"{promoted.get('version', '?')} at {promoted.get('time', '?')}",
        ]
        lines += [f"- data: `{source['uri']}`" for source in promoted.get("data", [])]
        lines += ["", *_evaluation(promoted)]
    return _front_matter(info, family, promoted) + "\n" + "\n".join(lines) + "\n"
