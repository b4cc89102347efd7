"""``alignpipe run-presets [NAME]``: the run presets, their per-chip memory arithmetic and flags.

Without a name: one line per preset with each stage's estimated peak per chip.
With one: the arithmetic of every stage, the pipeline parameters it sets
(``alignpipe compile --run-preset NAME`` sets them; the pipeline places a multi-host
slice itself: one custom job on Vertex, a JobSet on GKE), and each stage's command for
running it by hand on every worker of a TPU VM slice.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipelines.dag.memory import CHIP_HBM, HEADROOM, GiB
from pipelines.dag.run_presets import RL_ALGORITHMS, RUN_PRESETS, STAGES, RunPreset, estimate

STAGE_MODULES = {s: f"components.{s}" for s in STAGES}
PHASES = ("train", "reference", "prefill", "decode", "scoring", "update")
SHARD_PATHS = "--input PREFS --output SHARDS --tokenizer BASE/tokenizer"
STAGE_PATHS = {
    "sft": "--shards SHARDS --base-policy BASE --output SFT",
    "reward": "--shards SHARDS --base-policy BASE --output RM",
    "ppo": "--shards SHARDS --policy SFT --reward-model RM --output ALIGNED",
    "dpo": "--shards SHARDS --policy SFT --output ALIGNED",
    "evaluate": "--shards SHARDS --policy ALIGNED --reference SFT --reward-model RM --output EVAL",
}


def add_run_presets(parser: argparse.ArgumentParser) -> None:
    """``alignpipe run-presets [NAME]``."""
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("name", nargs="?", choices=sorted(RUN_PRESETS), help="one preset")
    parser.set_defaults(handler=_presets)


# The rows of the summary: each stage, and the ppo stage once per RL algorithm.
UNITS = (("sft", "sft", "ppo"), ("reward", "reward", "ppo"),
         *((name, "ppo", name) for name in RL_ALGORITHMS),
         ("dpo", "dpo", "ppo"), ("evaluate", "evaluate", "ppo"))  # fmt: skip


def summary_line(name: str, preset: RunPreset) -> str:
    """``name  model  slice  peak GiB per algorithm ...  / budget``."""
    peaks = "  ".join(
        f"{unit} {estimate(preset, stage, algorithm=algorithm)['total'] / GiB:5.1f}"
        for unit, stage, algorithm in UNITS
    )
    budget = HEADROOM * CHIP_HBM[preset.chip] / GiB
    hosts = f"{preset.hosts} host" + ("s" if preset.hosts > 1 else "")
    tuning = f"LoRA r{preset.lora_rank}" if preset.lora_rank else "full"
    return (
        f"{name:14s} {preset.example:34s} {preset.slice_name:7s} {hosts:7s} {tuning:8s} "
        f"GiB per chip: {peaks}  (budget {budget:.1f})"
    )


def tuning_line(preset: RunPreset) -> str:
    """How the preset fine-tunes: every weight, or LoRA adapters on a frozen base."""
    if not preset.lora_rank:
        return "  full fine-tuning: frozen = reference and reward models, trained = the rest"
    n, adapters = estimate(preset, "sft")["params"], preset.adapter_params()
    return (
        f"  LoRA rank {preset.lora_rank}, alpha {preset.lora_alpha:g}, on {preset.lora_targets}: "
        f"{adapters / 1e6:.1f}M adapter params per network ({adapters / n:.2%} of N); "
        f"base = frozen bases in {preset.dtype}, adapters = adapters and heads trained "
        "(evaluate: merged float32 models)"
    )


def _flag(name: str, value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--{name.replace('_', '-')} {text}"


def describe(name: str) -> str:
    """The arithmetic, pipeline parameters and stage commands of one preset."""
    preset = RUN_PRESETS[name]
    budget = HEADROOM * CHIP_HBM[preset.chip]
    config = preset.config()
    lines = [
        f"{name}: the model class of {preset.example} ({preset.model} preset, vocab "
        f"{preset.vocab_size}) on "
        f"{preset.slice_name}: {preset.chips} {preset.chip} chips of "
        f"{CHIP_HBM[preset.chip] / GiB:.0f} GiB on {preset.hosts} host(s); a run may use "
        f"{HEADROOM:.0%} = {budget / GiB:.1f} GiB per chip",
        f"  {config.n_layers} layers, dim {config.dim}, {config.dtype} compute, remat "
        f"{config.remat}, fsdp {str(preset.fsdp).lower()}; prompts {preset.prompt_len} + "
        f"responses {preset.response_len} tokens",
        tuning_line(preset),
        "",
        f"  {'stage':10s} params {'base' if preset.lora_rank else 'frozen':>7s} "
        f"{'adapters' if preset.lora_rank else 'trained':>8s}  state  "
        + "".join(f"{phase:>10s}" for phase in PHASES)
        + "  peak GiB per chip",
    ]
    for unit, stage, algorithm in UNITS:
        e = estimate(preset, stage, algorithm=algorithm)
        cells = "".join(
            f"{e['phases'][p] / GiB:10.2f}" if p in e["phases"] else f"{'':10s}" for p in PHASES
        )
        lines.append(
            f"  {unit:10s}{e['params'] / 1e9:6.2f}B {e['frozen'] / GiB:7.2f} "
            f"{e['trained'] / GiB:8.2f} {e['state'] / GiB:6.2f}{cells} {e['total'] / GiB:6.2f}"
        )
    params = " ".join(_flag(k, v) for k, v in preset.pipeline_params().items())
    lines += ["", "  pipeline parameters (compile, submit and schedule --run-preset set them):"]
    lines.append(f"    {params}")
    lines += ["", "  stage commands (shard once; the others on every worker of the slice):"]
    lengths = " ".join(_flag(k, v) for k, v in preset.flags("shard").items())
    lines.append(f"    alignpipe data shard {SHARD_PATHS} {lengths}")
    for stage in STAGES:
        flags = " ".join(_flag(k, v) for k, v in preset.flags(stage).items())
        lines.append(f"    python -m {STAGE_MODULES[stage]} {STAGE_PATHS[stage]} {flags}")
    return "\n".join(lines)


def _presets(args: argparse.Namespace, rest: list[str]) -> int:
    if args.name:
        print(describe(args.name))
    else:
        for name, preset in sorted(RUN_PRESETS.items()):
            print(summary_line(name, preset))
    return 0
