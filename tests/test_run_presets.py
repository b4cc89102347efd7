"""Run presets: the memory arithmetic's parameter counts, each preset's fit, each stated limit."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx

from components.core.model import Transformer
from components.core.model_config import model_config
from components.core.run_presets import (
    CHIP_HBM,
    HEADROOM,
    RUN_PRESETS,
    RunPreset,
    estimate,
    fits,
    param_count,
)
from components.core.trainer import TrainConfig
from components.ppo.config import PPOConfig


@pytest.mark.parametrize(
    ("preset", "vocab"), [("tiny", 61), ("0.5b", 151936), ("1b", 128256), ("2b", 256000)]
)
def test_param_count_is_the_models(preset, vocab):
    config = model_config(preset, vocab)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    assert param_count(config) == sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))


@pytest.mark.parametrize(
    ("name", "stage"), [(n, s) for n, p in sorted(RUN_PRESETS.items()) for s in p.stages]
)
def test_every_preset_stage_fits_its_chip(name, stage):
    preset = RUN_PRESETS[name]
    assert fits(preset, stage), estimate(preset, stage)
    flags = dict(preset.stages[stage])
    if stage == "ppo":
        # The slice's devices, not this machine's: check the fields, not divisibility.
        assert {f.name for f in dataclasses.fields(PPOConfig)} >= set(flags)
    else:
        TrainConfig(**flags)


def _on(chip: str, model: str, vocab: int, stage: str, flags: dict) -> RunPreset:
    return RunPreset(
        model=model, vocab_size=vocab, example="", chip=chip, chips=8, stages={stage: flags}
    )


SMALL_SFT = {"batch_size": 8, "max_len": 256, "remat": "full", "dtype": "bfloat16"}
SMALL_PPO = {
    "rollout_batch_size": 8,
    "minibatches": 1,
    "prompt_len": 64,
    "max_new_tokens": 64,
    "remat": "full",
    "dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("chip", "model", "vocab", "stage", "flags"),
    [
        ("v5e", "1b", 128256, "sft", SMALL_SFT),  # 1B-class: state alone exceeds a v5e chip
        ("v5e", "0.5b", 151936, "ppo", SMALL_PPO),  # 0.5B PPO: 48 N > 16 GB
        ("v5p", "7b", 32000, "sft", SMALL_SFT),  # 7B-class: 20 N = 135 GB > 95 GB
    ],
)
def test_stated_limits_hold(chip, model, vocab, stage, flags):
    preset = _on(chip, model, vocab, stage, flags)
    assert estimate(preset, stage)["state"] > HEADROOM * CHIP_HBM[chip]
    assert not fits(preset, stage)
