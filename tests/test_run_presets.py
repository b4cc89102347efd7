"""Run presets: the arithmetic's parameter counts, each preset's fit, each stated limit, the CLI."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx

from components.core.config import ALL_LINEAR, LORA_TARGETS
from components.core.model import layer_kinds, lora
from components.core.model.config import ModelConfig
from components.core.model.lora import TARGET_PATHS
from components.core.model.presets import model_config
from components.core.model.transformer import Transformer
from components.dpo.config import DPOConfig
from components.evaluate.config import EvalConfig
from components.ppo.config import PPOConfig
from components.reward.config import RewardConfig
from components.sft.config import SFTConfig
from pipelines.cli.main import main as cli_main
from pipelines.dag import param_table, params
from pipelines.dag.memory import (
    CHIP_HBM,
    HEADROOM,
    GiB,
    adapter_param_count,
    layer_param_count,
    outer_param_count,
    param_count,
    projection_shapes,
)
from pipelines.dag.run_presets import RUN_PRESETS, STAGES, estimate, fits, params_for
from pipelines.targets.spec import read_spec

STAGE_CONFIGS = {
    "sft": SFTConfig, "reward": RewardConfig, "ppo": PPOConfig, "dpo": DPOConfig,
    "evaluate": EvalConfig,
}  # fmt: skip
LORA_PRESETS = ("v5p-8-7b-lora", "v5e-4-1b-lora")


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


@pytest.mark.parametrize("preset", ["gemma4-e4b", "gemma4-31b", "qwen3.5-9b", "qwen3-30b-a3b"])
def test_param_count_of_stacks_of_several_kinds_is_the_models(preset):
    """Gemma 4's kinds (full layers wider, shared layers without keys, the per-layer input
    table) and Qwen3.5's: the planner's count is the model's, its largest layer fsdp's
    gathered one, and a LoRA run's adapters those lora.attach places."""
    config = model_config(preset, 262144)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract)
    assert param_count(config) == sum(x.size for x in jax.tree.leaves(state))
    layers = [
        sum(x.size for x in jax.tree.leaves(state[stack])) // count
        for stack, count in layer_kinds.stack_counts(config).items()
        if stack != "linear_blocks"
    ]
    assert layer_param_count(config) == max(layers)
    adapted = lora.with_lora(config, 8, 16.0, LORA_TARGETS)
    abstract = nnx.eval_shape(lambda: Transformer(adapted, rngs=nnx.Rngs(0)))
    adapters = nnx.filter_state(nnx.state(abstract), nnx.LoRAParam)
    counted = adapter_param_count(config, 8, LORA_TARGETS)
    assert counted == sum(x.size for x in jax.tree.leaves(adapters))


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
        assert params.stage_values(stage, values)["lora_rank"] == preset.lora_rank
    assert ("lora_rank" in preset.pipeline_params()) is bool(preset.lora_rank)


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


def test_one_b_ppo_on_v5e_does_not_fit_2048_token_responses():
    """The gathered embeddings (two networks', with their gradients) leave room for 1,024."""
    assert fits(_variant("v5e-8-1b", response_len=1024), "ppo")
    assert not fits(_variant("v5e-8-1b", response_len=2048), "ppo")


def test_seven_b_needs_the_larger_slice():
    seven = RUN_PRESETS["v5p-32-7b"]
    assert estimate(_variant("v5p-32-7b", fsdp=False), "sft")["state"] > CHIP_HBM["v5p"]
    # One v5p-8 host (4 chips): 64 rollouts a chip of 2,048 tokens hold a 69 GB KV cache
    # (Llama-2-7B has no grouped-query attention) beside 48 N / 4 = 81 GB of state.
    host = _variant("v5p-32-7b", chips=4, hosts=1)
    assert estimate(host, "ppo")["phases"]["prefill"] > HEADROOM * CHIP_HBM["v5p"]
    assert not fits(host, "ppo")
    assert estimate(seven, "ppo")["state"] == pytest.approx(48 * 6.738e9 / 16, rel=1e-3)


def test_presets_command_prints_the_arithmetic_and_the_flags(capsys):
    assert cli_main(["run-presets"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in RUN_PRESETS)
    assert cli_main(["run-presets", "v5p-32-7b"]) == 0
    text = capsys.readouterr().out
    ppo = estimate(RUN_PRESETS["v5p-32-7b"], "ppo")
    assert f"{ppo['state'] / GiB:6.2f}" in text and f"{ppo['total'] / GiB:6.2f}" in text
    assert "python -m components.ppo" in text and "--fsdp true" in text
    assert "4 host(s)" in text


def test_compile_with_a_run_preset_sets_tpu_and_parameters(tmp_path, capsys):
    out = tmp_path / "pipeline.yaml"
    argv = ["compile", "--target", "gke", "--run-preset", "v5e-8-1b", "-o", str(out)]
    assert cli_main([*argv, "--sft-batch-size", "16"]) == 0  # a flag overrides the preset
    assert "2x4" in capsys.readouterr().out
    spec, platform = read_spec(out)
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


def test_mistral_small_4_needs_a_v5p_128():
    """Mistral Small 4 (118.97e9 parameters) with LoRA: a v5p-64 does not hold evaluate's
    merged float32 models, and no v5e slice a gathered layer (its 128 experts: fsdp gathers
    a layer whole) beside the rest, even sft's on 256 chips."""
    preset = RUN_PRESETS["v5p-128-mistral-small-4-lora"]
    assert param_count(preset.config()) == pytest.approx(118.97e9, rel=1e-4)
    assert all(fits(preset, stage) for stage in STAGES)
    assert not fits(_variant(preset_name := "v5p-128-mistral-small-4-lora", chips=32, hosts=8),
                    "evaluate")  # fmt: skip
    v5e = _variant(preset_name, chip="v5e", chips=256, hosts=64)
    assert estimate(v5e, "sft")["total"] > HEADROOM * CHIP_HBM["v5e"]


def test_half_b_needs_fsdp_for_ppo():
    replicated = _variant("v5e-8-0.5b", fsdp=False)
    budget = HEADROOM * CHIP_HBM["v5e"]
    assert estimate(replicated, "ppo")["state"] == pytest.approx(48 * 0.494e9, rel=1e-2)
    assert estimate(replicated, "ppo")["state"] > budget
    # Its logits a tile at a time, sft fits replicated at the preset's batch (whole, its
    # 32 / 8 sequences' 768 × 151,936 fp32 logits and their gradient took 3.7 GB more).
    assert fits(replicated, "sft") and fits(replicated, "reward")


def test_evaluate_spreads_each_hosts_batch_over_its_own_chips():
    seven = RUN_PRESETS["v5p-32-7b"]
    wider = _variant("v5p-32-7b", stages={**seven.stages, "evaluate": {"batch_size": 256}})
    # Every host evaluates every row: 256 per host is 64 sequences per chip, not 16.
    one_host = _variant("v5p-32-7b", hosts=1)
    wider_one = dataclasses.replace(wider, hosts=1)

    def added(narrow, wide):  # what 128 more rows per host add to a chip
        return estimate(wide, "evaluate")["total"] - estimate(narrow, "evaluate")["total"]

    # Every host evaluates every row: 256 per host is 64 sequences per chip, not 16.
    assert added(seven, wider) / added(one_host, wider_one) == pytest.approx(4.0, rel=0.05)
    assert not fits(wider, "evaluate")


def test_pipeline_params_are_read_off_the_parameter_table():
    seven = RUN_PRESETS["v5p-32-7b"]
    expected = {}
    for param in param_table.PARAMS:  # every parameter whose stage fields the preset sets
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
    assert "alignpipe run-presets v5p-24-odd" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("preset", "vocab"), [("tiny", 61), ("0.5b", 151936), ("1b", 128256), ("2b", 256000)]
)
def test_projection_shapes_are_the_models_kernels(preset, vocab):
    config = model_config(preset, vocab)
    blocks = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))["blocks"]
    for target, (attn_or_mlp, name) in TARGET_PATHS.items():
        if attn_or_mlp == "delta" or not config.target_stacks(target):
            continue  # Qwen3.5's DeltaNet projections: test_qwen3_5.py; latent: test_mistral4.py
        kernel = blocks[attn_or_mlp][name]["kernel"]
        assert kernel.shape == (config.n_layers, *projection_shapes(config)[target]), target


def test_adapter_count_of_llama_2_7b():
    config = model_config("7b", 32000)
    # r·(in + out) per target per layer, written out: q, k, v (4096 → 4096), o, and
    # gate, up (4096 → 11008) and down (11008 → 4096).
    by_hand = 8 * 32 * (3 * (4096 + 4096) + (4096 + 4096) + 3 * (4096 + 11008))
    assert adapter_param_count(config, 8, LORA_TARGETS) == by_hand == 19_988_480
    # PEFT's count for Llama-2-7B, r = 8 on q_proj and v_proj: 4,194,304.
    assert adapter_param_count(config, 8, ("q_proj", "v_proj")) == 4_194_304
    assert RUN_PRESETS["v5p-8-7b-lora"].adapter_params() == 2 * by_hand  # rank 16


@pytest.mark.skipif(
    "lora_rank" not in {f.name for f in dataclasses.fields(ModelConfig)},
    reason="the model has no LoRA fields yet",
)
@pytest.mark.parametrize(("preset", "vocab"), [("0.5b", 151936), ("2b", 256000), ("7b", 32000)])
def test_adapter_count_is_the_lora_models(preset, vocab):
    targets = ("q_proj", "o_proj", "down_proj")
    for chosen in (LORA_TARGETS, targets):
        config = dataclasses.replace(model_config(preset, vocab), lora_rank=4, lora_targets=chosen)
        abstract = nnx.eval_shape(lambda config=config: Transformer(config, rngs=nnx.Rngs(0)))
        adapters = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.LoRAParam)))
        assert adapter_param_count(config, 4, chosen) == adapters


def test_seven_b_lora_fits_one_v5p_host_with_fsdp_for_evaluate():
    preset = RUN_PRESETS["v5p-8-7b-lora"]
    n, adapters, head = 6.738e9, 39_976_960, 4096 + 1
    budget = HEADROOM * CHIP_HBM["v5p"]
    assert (preset.chips, preset.hosts, preset.fsdp) == (4, 1, True)
    # PPO: two bf16 bases, policy and critic adapters at 20 bytes, the critic's head trained
    # and the reward model's frozen; over 4 chips.
    ppo = estimate(preset, "ppo")
    assert ppo["frozen"] == pytest.approx((2 * 2 * n + 2 * head) / 4, rel=1e-3)
    assert ppo["trained"] == pytest.approx(20 * (2 * adapters + head) / 4, rel=1e-6)
    assert ppo["state"] == pytest.approx(7.14e9, rel=2e-3)
    assert estimate(preset, "sft")["state"] == pytest.approx(3.57e9, rel=2e-3)
    assert estimate(preset, "evaluate")["state"] == pytest.approx(12 * n / 4, rel=1e-3)
    assert max(estimate(preset, s)["total"] for s in STAGES) < 60 * GiB
    # Replicated: the trained stages fit (PPO's state 28.6 GB instead of 48 N), evaluate not.
    replicated = _variant("v5p-8-7b-lora", fsdp=False)
    assert estimate(replicated, "ppo")["state"] == pytest.approx(28.6e9, rel=2e-3)
    assert all(fits(replicated, s) for s in ("sft", "reward", "ppo"))
    assert estimate(replicated, "evaluate")["total"] > budget and not fits(replicated, "evaluate")
    # Full fine-tuning on the same host: PPO's 48 N / 4 = 80.9 GB of state, 11x LoRA's.
    full = _variant("v5p-8-7b-lora", lora_rank=0)
    assert estimate(full, "ppo")["state"] == pytest.approx(48 * n / 4, rel=1e-3)
    assert estimate(full, "ppo")["state"] > 11 * ppo["state"]


def test_seven_b_lora_evaluate_barely_fits_a_v5e_8():
    """Why the 7B LoRA preset is on v5p-8: on v5e-8 evaluate's merged float32 models (10.1 GB
    a chip) and what fsdp gathers leave room for one sequence a chip, not the preset's eight."""
    preset = RUN_PRESETS["v5p-8-7b-lora"]
    v5e = _variant("v5p-8-7b-lora", chip="v5e", chips=8)
    assert estimate(v5e, "evaluate")["state"] == pytest.approx(10.1e9, rel=0.01)
    assert not fits(v5e, "evaluate")
    one = _variant(
        "v5p-8-7b-lora",
        chip="v5e",
        chips=8,
        stages={**preset.stages, "evaluate": {"batch_size": 8}},
    )
    assert fits(one, "evaluate")
    assert estimate(one, "evaluate")["total"] > 0.95 * HEADROOM * CHIP_HBM["v5e"]


def test_one_b_lora_fits_a_v5e_4_with_fsdp_for_evaluate():
    preset = RUN_PRESETS["v5e-4-1b-lora"]
    n, budget = 1.2358e9, HEADROOM * CHIP_HBM["v5e"]
    assert (preset.chips, preset.fsdp, preset.response_len) == (4, True, 512)
    assert preset.response_len == 2 * RUN_PRESETS["v5e-8-1b"].response_len
    assert estimate(preset, "ppo")["frozen"] == pytest.approx(2 * 2 * n / 4, rel=1e-3)
    replicated = _variant("v5e-4-1b-lora", fsdp=False)
    assert estimate(replicated, "ppo")["state"] == pytest.approx(5.4e9, rel=0.01)
    assert all(fits(replicated, s) for s in ("sft", "reward", "ppo"))
    assert estimate(replicated, "evaluate")["state"] == pytest.approx(12 * n, rel=1e-3)
    assert estimate(replicated, "evaluate")["total"] > budget and not fits(replicated, "evaluate")
    full = _variant("v5e-4-1b-lora", lora_rank=0)
    assert not fits(full, "ppo")  # sft fits since its logits live a tile at a time
    assert estimate(full, "ppo")["state"] == pytest.approx(48 * n / 4, rel=1e-3)
    assert fits(full, "ppo", algorithm="grpo")  # without a critic


@pytest.mark.parametrize("name", LORA_PRESETS)
def test_lora_presets_set_lora_on_the_trained_stages_only(name):
    preset = RUN_PRESETS[name]
    full = RUN_PRESETS["v5e-8-1b"]
    for stage in ("sft", "reward", "ppo"):
        config = STAGE_CONFIGS[stage](**preset.flags(stage))
        assert (config.lora_rank, config.lora_alpha, config.lora_targets) == (16, 32, ALL_LINEAR)
        # Adapters learn at ten times full fine-tuning's rate.
        rate = full.flags(stage)["learning_rate"]
        assert config.learning_rate == pytest.approx(10 * rate)
    assert not any(field.startswith("lora") for field in preset.flags("evaluate"))


def test_presets_command_shows_the_lora_split(capsys):
    assert cli_main(["run-presets"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in LORA_PRESETS) and "LoRA r16" in listing
    assert cli_main(["run-presets", "v5p-8-7b-lora"]) == 0
    text = capsys.readouterr().out
    assert "base adapters" in text and "40.0M adapter params per network" in text
    ppo = estimate(RUN_PRESETS["v5p-8-7b-lora"], "ppo")
    assert f"{ppo['frozen'] / GiB:7.2f} {ppo['trained'] / GiB:8.2f}" in text
    assert "--lora-rank 16 --lora-alpha 32.0 --lora-targets all-linear" in text


def test_compile_with_a_lora_preset_sets_its_adapters(tmp_path, capsys):
    out = tmp_path / "pipeline.yaml"
    argv = ["compile", "--target", "gke", "--run-preset", "v5e-4-1b-lora", "-o", str(out)]
    assert cli_main(argv) == 0
    assert "2x2" in capsys.readouterr().out
    spec, _ = read_spec(out)
    compiled = spec["root"]["inputDefinitions"]["parameters"]
    assert compiled["lora_rank"]["defaultValue"] == 16
    assert compiled["fsdp"]["defaultValue"] is True
