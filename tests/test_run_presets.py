"""Run presets: the arithmetic's parameter counts, each preset's fit, each stated limit, the CLI."""

from __future__ import annotations

import dataclasses

import jax
import pytest
import yaml
from flax import nnx

from components.core.model.config import model_config
from components.core.model.transformer import Transformer
from components.evaluate.config import EvalConfig
from components.ppo.config import PPOConfig
from components.reward.config import RewardConfig
from components.sft.config import SFTConfig
from pipelines import params
from pipelines.cli import main as cli_main
from pipelines.run_presets import (
    CHIP_HBM,
    GB,
    HEADROOM,
    RUN_PRESETS,
    STAGES,
    estimate,
    fits,
    layer_param_count,
    outer_param_count,
    param_count,
    params_for,
)

STAGE_CONFIGS = {"sft": SFTConfig, "reward": RewardConfig, "ppo": PPOConfig, "evaluate": EvalConfig}


@pytest.mark.parametrize(
    ("preset", "vocab"),
    [("tiny", 61), ("0.5b", 151936), ("1b", 128256), ("2b", 256000), ("7b", 32000)],
)
def test_param_count_is_the_models(preset, vocab):
    config = model_config(preset, vocab)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract)
    assert param_count(config) == sum(x.size for x in jax.tree.leaves(state))
    # The split fsdp gathers by: one layer of the stack, and everything outside it.
    blocks = sum(x.size for x in jax.tree.leaves(state["blocks"]))
    assert layer_param_count(config) * config.n_layers == blocks
    assert outer_param_count(config) == param_count(config) - blocks


@pytest.mark.parametrize(("name", "stage"), [(n, s) for n in sorted(RUN_PRESETS) for s in STAGES])
def test_every_preset_stage_fits_its_chip_and_its_flags_are_a_config(name, stage):
    preset = RUN_PRESETS[name]
    assert fits(preset, stage), estimate(preset, stage)
    config = STAGE_CONFIGS[stage](**preset.flags(stage))
    assert config.fsdp == preset.fsdp


@pytest.mark.parametrize("name", sorted(RUN_PRESETS))
def test_pipeline_params_of_a_preset_are_valid(name):
    preset = RUN_PRESETS[name]
    values = params.validate(preset.pipeline_params(), chips=preset.chips)
    assert values["fsdp"] is preset.fsdp and values["dtype"] == "bfloat16"
    for stage in ("sft", "reward", "ppo"):
        assert params.stage_values(stage, values)["remat"] == preset.remat


def _variant(name: str, **changes) -> object:
    return dataclasses.replace(RUN_PRESETS[name], **changes)


def test_one_b_on_v5e_needs_fsdp():
    preset = _variant("v5e-8-1b", fsdp=False)
    budget = HEADROOM * CHIP_HBM["v5e"]
    # Replicated, 20 N = 24.7 GB of state exceeds a v5e chip before any activation.
    assert estimate(preset, "sft")["state"] == pytest.approx(20 * 1.2358e9, rel=1e-3)
    assert all(estimate(preset, s)["state"] > budget for s in ("sft", "reward", "ppo"))
    assert estimate(RUN_PRESETS["v5e-8-1b"], "ppo")["state"] == pytest.approx(
        48 * 1.2358e9 / 8, rel=1e-3
    )


def test_one_b_ppo_on_v5e_does_not_fit_512_token_responses():
    """Why the preset's responses are 256 tokens: the gathered embeddings leave ~1.2 GB."""
    assert not fits(_variant("v5e-8-1b", response_len=512), "ppo")


def test_seven_b_needs_the_larger_slice():
    seven = RUN_PRESETS["v5p-32-7b"]
    assert estimate(_variant("v5p-32-7b", fsdp=False), "sft")["state"] > CHIP_HBM["v5p"]
    # One v5p-8 host (4 chips): PPO's 48 N / 4 = 81 GB of state alone exceeds the budget.
    host = _variant("v5p-32-7b", chips=4, hosts=1)
    assert estimate(host, "ppo")["state"] > HEADROOM * CHIP_HBM["v5p"]
    assert not fits(host, "ppo")
    assert estimate(seven, "ppo")["state"] == pytest.approx(48 * 6.738e9 / 16, rel=1e-3)


def test_presets_command_prints_the_arithmetic_and_the_flags(capsys):
    assert cli_main(["presets"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in RUN_PRESETS)
    assert cli_main(["presets", "v5p-32-7b"]) == 0
    text = capsys.readouterr().out
    ppo = estimate(RUN_PRESETS["v5p-32-7b"], "ppo")
    assert f"{ppo['state'] / GB:6.2f}" in text and f"{ppo['total'] / GB:6.2f}" in text
    assert "python -m components.ppo" in text and "--fsdp true" in text
    assert "4 host(s)" in text


def test_compile_with_a_run_preset_sets_tpu_and_parameters(tmp_path, capsys):
    out = tmp_path / "pipeline.yaml"
    argv = ["compile", "--target", "gke", "--run-preset", "v5e-8-1b", "-o", str(out)]
    assert cli_main([*argv, "--sft-batch-size", "16"]) == 0  # a flag overrides the preset
    assert "2x4" in capsys.readouterr().out
    spec, platform = yaml.safe_load_all(out.read_text())
    compiled = spec["root"]["inputDefinitions"]["parameters"]
    expected = {**RUN_PRESETS["v5e-8-1b"].pipeline_params(), "sft_batch_size": 16}
    for name, value in expected.items():
        assert compiled[name]["defaultValue"] == value, name
    assert "2x4" in str(platform)  # the training tasks' TPU topology node selector


def test_a_preset_on_another_slice_is_refused(tmp_path, capsys):
    argv = ["compile", "--target", "gke", "--run-preset", "v5e-8-1b", "-o", str(tmp_path / "p")]
    assert cli_main([*argv, "--tpu-topology", "2x2"]) == 2  # 4 chips: 1B's PPO needs 8
    assert "sized for 8 v5e chips" in capsys.readouterr().err
    assert cli_main([*argv, "--tpu", "v4"]) == 2
    assert "sized for 8 v5e chips" in capsys.readouterr().err


def test_half_b_needs_fsdp_for_ppo():
    replicated = _variant("v5e-8-0.5b", fsdp=False)
    budget = HEADROOM * CHIP_HBM["v5e"]
    assert estimate(replicated, "ppo")["state"] == pytest.approx(48 * 0.494e9, rel=1e-2)
    assert estimate(replicated, "ppo")["state"] > budget
    assert not fits(replicated, "sft") and fits(replicated, "reward")


def test_evaluate_spreads_each_hosts_batch_over_its_own_chips():
    seven = RUN_PRESETS["v5p-32-7b"]
    wider = _variant("v5p-32-7b", stages={**seven.stages, "evaluate": {"batch_size": 256}})
    # Every host evaluates every row: 256 per host is 64 sequences per chip, not 16.
    ratio = estimate(wider, "evaluate")["activations"] / estimate(seven, "evaluate")["activations"]
    assert ratio == pytest.approx(4.0, rel=0.05)
    assert not fits(wider, "evaluate")


def test_pipeline_params_are_read_off_the_parameter_table():
    seven = RUN_PRESETS["v5p-32-7b"]
    expected = {}
    for param in params.PARAMS:  # every parameter whose stage fields the preset sets
        for stage, field in param.targets:
            fields = seven.flags(stage) if stage in (*STAGES, "shard") else {}
            if field in fields:
                expected[param.name] = fields[field]
    assert seven.pipeline_params() == expected
    assert expected["max_len"] == 2048 and expected["eval_max_new_tokens"] == 1024
    assert expected["min_eval_pairs"] == 128 and expected["preset"] == "7b"


def test_a_shared_parameter_given_two_values_is_refused():
    fields = {"sft": {"remat": "full"}, "reward": {"remat": "none"}}
    with pytest.raises(ValueError, match="parameter remat sets sft.remat, reward.remat alike"):
        params_for(fields)
    assert params_for({"sft": {"remat": "full"}, "reward": {"remat": "full"}}) == {"remat": "full"}


def test_a_preset_of_a_slice_the_pipeline_cannot_place_is_refused(tmp_path, capsys, monkeypatch):
    odd = _variant("v5p-32-7b", chips=12, hosts=3)  # 12 v5p chips: no slice of that size
    monkeypatch.setitem(RUN_PRESETS, "v5p-24-odd", odd)
    argv = ["compile", "--target", "gke", "--run-preset", "v5p-24-odd", "-o", str(tmp_path / "p")]
    assert cli_main(argv) == 2
    assert "alignpipe presets v5p-24-odd" in capsys.readouterr().err
