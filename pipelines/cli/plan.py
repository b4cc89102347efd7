"""``alignpipe plan --run-preset NAME [flags] [--compile]``: what each stage of a run holds
on one chip, phase by phase, before anything is submitted.

The planner's figures (``pipelines/dag/phases.py``) come with the flags applied over the
preset, for the stages the chosen ``--algorithm`` runs, against the chip's physical HBM and
the run's budget (``memory.HEADROOM`` of it). ``--compile`` also compiles the stages'
programs ahead of time on this machine's CPU (``pipelines/dag/compiled.py``: abstract
shapes, no weight allocated; one CPU device per chip of the slice, in a process of its own)
and prints XLA's figure of each program beside the planner's. The run is then checked as
``compile``, ``submit`` and ``run`` check it: exit status 2 where a stage does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pipelines.cli import options
from pipelines.dag import fit, memory
from pipelines.dag.memory import GiB
from pipelines.dag.phases import peak
from pipelines.dag.run_presets import ALGORITHM_STAGES, RUN_PRESETS, stage_phases

# Which planner phases a compiled program holds (the rollout samples and scores in one).
PROGRAM_PHASES = {
    "train": ("train",),
    "update": ("update", "train"),
    "reference": ("reference",),
    "rollout": ("prefill", "decode", "scoring"),
}


def add_plan(parser: argparse.ArgumentParser) -> None:
    """``alignpipe plan``."""
    parser.description = __doc__.splitlines()[0]
    parser.add_argument(
        "--run-preset", required=True, choices=sorted(RUN_PRESETS),
        help="a model class on a TPU slice (alignpipe run-presets)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true",
        help="also compile each stage's programs on this CPU and print XLA's figures "
        "(about 30 s a stage set for the 1B presets on 2 cores)",
    )  # fmt: skip
    options.add_param_flags(parser, note="given over the preset")
    parser.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace, rest: list[str]) -> int:
    return options.guard(lambda: plan(args))


def plan(args: argparse.Namespace) -> int:
    values, _ = options.given(args)
    preset, stages = fit.applied(RUN_PRESETS[args.run_preset], values)
    algorithm = values.get("algorithm", "ppo")
    hbm, budget = memory.CHIP_HBM[preset.chip], fit.budget(preset)
    print(
        f"{args.run_preset} with {algorithm}: {preset.chips} {preset.chip} chips of "
        f"{hbm / GiB:.0f} GiB; a run may use {memory.HEADROOM:.0%} = {budget / GiB:.1f} GiB a chip"
    )
    compiled = _compiled(args.run_preset, values, preset.chips) if args.compile else {}
    for stage in ALGORITHM_STAGES[algorithm]:
        overrides = {k: v for k, v in stages[stage].items() if k != "algorithm"}
        found = stage_phases(preset, stage, overrides, algorithm=algorithm)
        top = peak(found)
        print(f"  {stage}: peak {top.total / GiB:.2f} GiB in {top.name}")
        for phase in found:
            print(
                f"    {phase.name:10s} program {phase.program / GiB:7.2f}  resident "
                f"{phase.resident / GiB:6.2f}  total {phase.total / GiB:7.2f} GiB"
            )
        for line in compiled.get(stage, []):
            print(_xla_line(line, found))
    try:
        fit.check(RUN_PRESETS[args.run_preset], values)
    except fit.FitError as error:
        print(f"error: {error}", file=sys.stderr)
        return options.EXIT_USAGE
    print("fits: every stage is within the budget")
    return 0


def _xla_line(line: dict, found: list) -> str:
    if "skipped" in line:
        return f"    XLA: {line['skipped']}"
    names = PROGRAM_PHASES[line["program"]]
    planned = max(p.program for p in found if p.name in names)
    xla = line["argument"] + line["temp"]
    return (
        f"    XLA {line['program']:9s} program {xla / GiB:7.2f} (planner {planned / GiB:.2f}, "
        f"{planned / xla:.2f}x)  compiled in {line['seconds']:.0f} s"
    )


def _compiled(name: str, values: dict, chips: int) -> dict[str, list[dict]]:
    """XLA's figures of each stage's programs, compiled for ``chips`` CPU devices: in this
    process where it already has them (the tests' 8), else in a process of its own."""
    import jax

    print(f"compiling each stage's programs for {chips} CPU devices ...", flush=True)
    if jax.default_backend() == "cpu" and jax.local_device_count() == chips:
        from pipelines.dag.compiled import preset_programs

        lines = preset_programs(RUN_PRESETS[name], values)
    else:
        lines = _in_a_process(name, values, chips)
    found: dict[str, list[dict]] = {}
    for line in lines:
        found.setdefault(line["stage"], []).append(line)
    return found


def _in_a_process(name: str, values: dict, chips: int) -> list[dict]:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={chips}",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    command = [sys.executable, "-m", "pipelines.dag.compiled", name, json.dumps(values)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"compiling the programs failed:\n{done.stderr[-4000:]}")
    return [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
