"""The stage configs: shared fields defined once in core/config.py's groups, read without JAX."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from components.core.config import (
    CheckpointSettings,
    NumericsSettings,
    OptimizerSettings,
    ReproducibilitySettings,
)
from components.dpo.config import DPOConfig
from components.ppo.config import PPOConfig
from components.reward.config import RewardConfig
from components.sft.config import SFTConfig

TRAINING_CONFIGS = (SFTConfig, RewardConfig, DPOConfig, PPOConfig)
GROUPS = (NumericsSettings, OptimizerSettings, CheckpointSettings, ReproducibilitySettings)
STAGES = ("sft", "reward", "dpo", "ppo", "evaluate")

# A stage package imports its stage (JAX) only when `run` is first used (module __getattr__).
_PROBE = """
import importlib, sys
stage = sys.argv[1]
config = importlib.import_module(f"components.{stage}")
vars(config)  # the package and its config module, nothing more
print(",".join(m for m in ("jax", "flax", "optax", "orbax") if m in sys.modules))
"""


@pytest.mark.parametrize("stage", STAGES)
def test_config_module_imports_no_jax(stage):
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, stage], capture_output=True, text=True, check=True
    )
    assert probe.stdout.strip() == "", f"components.{stage} imported {probe.stdout}"


@pytest.mark.parametrize("config_cls", TRAINING_CONFIGS)
def test_shared_fields_take_their_help_from_the_group(config_cls):
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for group in GROUPS:
        for shared in dataclasses.fields(group):
            if shared.name == "learning_rate":  # its help names the stage's own auto rates
                continue
            assert fields[shared.name].metadata["help"] == shared.metadata["help"], shared.name


def test_stage_defaults_where_they_differ_from_the_group():
    ppo, sft = PPOConfig(), SFTConfig()
    assert (sft.warmup_steps, sft.save_every, sft.keep_checkpoints) == (30, 100, 2)
    assert (ppo.warmup_steps, ppo.save_every, ppo.keep_checkpoints) == (10, 5, 2)
    assert DPOConfig().steps == 100 and sft.steps == 300


@pytest.mark.parametrize("config_cls", TRAINING_CONFIGS)
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"save_every": 0}, "save_every: 0 must be at least 1"),
        ({"keep_checkpoints": 0}, "keep_checkpoints: 0 must be at least 1"),
        ({"data_streams": -1}, r"data_streams: -1 must be >= 0 \(0 = one per host\)"),
        ({"learning_rate": -1.0}, "learning_rate: -1.0 must be > 0, or 0 for auto"),
        ({"lora_rank": -1}, "lora_rank: -1 must be >= 0"),
    ],
)
def test_group_checks_refuse_with_one_message(config_cls, override, message):
    with pytest.raises(ValueError, match=message):
        config_cls(**override)


def test_ppo_refuses_a_negative_critic_learning_rate():
    with pytest.raises(ValueError, match="critic_learning_rate: -1.0 must be > 0, or 0 for auto"):
        PPOConfig(critic_learning_rate=-1.0)


@pytest.mark.parametrize("config_cls", TRAINING_CONFIGS)
def test_configs_keep_slots(config_cls):
    config = config_cls()
    assert not hasattr(config, "__dict__")
    with pytest.raises(AttributeError):
        config.not_a_field = 1


@pytest.mark.parametrize(
    ("make", "name", "value"),
    [
        # Each passed its `< 0` check before: nan compares false with everything.
        (PPOConfig, "kl_coef", float("nan")),
        (PPOConfig, "vf_coef", float("nan")),
        (PPOConfig, "learning_rate", float("inf")),
        (SFTConfig, "weight_decay", float("nan")),
        (DPOConfig, "lora_alpha", float("inf")),
    ],
)
def test_nan_and_inf_are_refused_naming_the_field(make, name, value):
    with pytest.raises(ValueError, match=f"^{name}: {value} must be a finite number$"):
        make(**{name: value})


def test_inf_turns_off_the_evaluate_limits_that_say_so():
    from components.evaluate.config import EvalConfig

    assert EvalConfig(max_kl=float("inf"), max_anchor_kl=float("inf")).max_kl == float("inf")
    with pytest.raises(ValueError, match="^max_kl: nan must be a finite number$"):
        EvalConfig(max_kl=float("nan"))
