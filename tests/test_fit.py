"""A run preset with flags over it is re-estimated before compile, submit or run: a stage
that does not fit its chip is refused with its figure, the chip's memory and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from pipelines.cli.main import main
from pipelines.dag import fit, memory
from pipelines.dag.run_presets import RUN_PRESETS, STAGES, estimate


@pytest.mark.parametrize("name", sorted(RUN_PRESETS))
def test_every_preset_as_given_fits(name):
    fit.check(RUN_PRESETS[name], RUN_PRESETS[name].pipeline_params())


def test_flags_over_a_preset_reach_the_stages_they_set():
    preset, stages = fit.applied(
        RUN_PRESETS["v5e-8-1b"],
        {"max_new_tokens": 1024, "eval_max_new_tokens": 64, "max_prompt_tokens": 256,
         "ppo_rollout_batch_size": 256, "fsdp": False},
    )  # fmt: skip
    assert preset.prompt_len == 256 and not preset.fsdp
    assert stages["ppo"] == {"max_new_tokens": 1024, "rollout_batch_size": 256, "prompt_len": 256}
    assert stages["evaluate"]["max_new_tokens"] == 64 and stages["sft"] == {}
    grown = estimate(preset, "ppo", stages["ppo"])["total"]
    assert grown > estimate(RUN_PRESETS["v5e-8-1b"], "ppo")["total"]


def test_compile_refuses_a_run_that_does_not_fit_with_the_fix(tmp_path, capsys):
    """The issue's command: 4x the responses and rollouts of v5e-8-1b."""
    args = ["compile", "-o", str(tmp_path / "p.yaml"), "--target", "vertex",
            "--run-preset", "v5e-8-1b", "--max-new-tokens", "1024",
            "--ppo-rollout-batch-size", "256"]  # fmt: skip
    assert main(args) == 2
    error = capsys.readouterr().err
    assert "ppo needs 21.1 GiB per chip, over the 14.4 GiB a v5e chip (16 GiB)" in error
    fix = "--ppo-rollout-batch-size 128 --ppo-minibatches 8"
    assert f"fix: {fix}\n" in error + "\n"
    assert not (tmp_path / "p.yaml").exists()
    assert main([*args[:-2], *fix.split()]) == 0  # the fix it names fits
    # GRPO (no critic) at the same flags: half the update's networks, still too large.
    assert main([*args, "--algorithm", "grpo"]) == 2
    assert "ppo (grpo) needs" in capsys.readouterr().err


def test_the_fix_is_the_cheapest_that_fits():
    limit = fit.budget(RUN_PRESETS["v5e-8-1b"])
    replicated = dataclasses.replace(RUN_PRESETS["v5e-8-1b"], fsdp=False)
    with pytest.raises(fit.FitError, match="sft needs .* fix: --fsdp true"):
        fit.check(replicated, replicated.pipeline_params() | {"fsdp": False})
    # Past any batch: a 1B full fine-tune on a v5e-4 needs adapters for PPO.
    full = dataclasses.replace(RUN_PRESETS["v5e-4-1b-lora"], lora_rank=0)
    assert estimate(full, "ppo")["total"] > limit
    with pytest.raises(fit.FitError, match="ppo needs .* fix: --lora-rank 16"):
        fit.check(full, {"lora_rank": 0})
    assert all(stage in fit.BATCH for stage in STAGES) and memory.HEADROOM < 1
