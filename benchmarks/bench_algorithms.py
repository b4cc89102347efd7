"""PPO, GRPO, RLOO and DPO side by side on the built-in task, from one sft policy.

What ``make demo`` runs (the pipeline's defaults, pipelines/dag/param_table.py): the built-in task
is generated and sharded once, the sft policy and the reward model are trained once, then
PPO, GRPO and RLOO (``components.ppo --algorithm``) and DPO (``components.dpo``) each
start from that sft policy, and ``components.evaluate`` measures each against it with the
same reward model, the built-in gold reward and the demo's evaluation settings (same seed:
the sft policy's samples are the same in every evaluation). Every training stage runs in a
process of its own through its container entry point, as a pipeline task does, so its wall
time counts start-up and compilation as the demo's summary does (the RL stages' time also
includes their gold measure before and after). 8 virtual CPU devices, as the demo.

Update memory per device is ``_update_memory``'s: XLA's ``memory_analysis()`` of the
compiled pmapped program for the shapes the stage ran, plus the frozen parameters that stay
on the device meanwhile (DPO: the larger of its reference forward and its train step).

Every algorithm trains once per seed (``--seeds``, default 0,1,2: the seed of the RL and
DPO stages, so policy sampling and minibatch order; the sft policy, the reward model and the
evaluation's samples of the sft policy are shared). Per algorithm the table gives the mean
over seeds and the spread (min to max) of the gold gain, the gold win rate, the KL per token
(evaluation: k3 on the aligned policy's samples; training: the rollouts' KL after the first
tenth of the run, and the share of those rollouts within ±50% of ``kl_target``) and
``ppo_vs_best_of_n`` on best-of-n's any-n curve. Old and new estimands side by side: the
gold win rate of independent pairs and of the same-key pairs it replaced; the ratio to
best-of-n on its exact curve and on the chord between its measured n.

Targets: every RL algorithm's mean KL per token on its training rollouts within ±20% of
``kl_target``,
and its mean ``ppo_vs_best_of_n`` (exact) at least 1.0. On the first seed, as one run
decides them: GRPO and RLOO reach PPO's gold gain at no more KL per token, with less update
memory; DPO's gold-gain interval lies above zero. Gain and KL are judged alike, against
PPO's 95% interval (prompts resampled): the gain at least its low end, the KL at most its
high end; the point estimates and the paired differences to PPO on the same prompts are
printed beside them.

    python benchmarks/bench_algorithms.py [--seeds 0,1,2] [--work-dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ALIGNPIPE_CPU_DEVICES", "8")  # the demo's; the stage processes inherit it
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from components.core.entry import configure_cpu_devices  # noqa: E402

configure_cpu_devices()  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _seeds import format_seed_table, over_seeds, rollout_kl, seed_targets  # noqa: E402
from _update_memory import dpo_step_memory, rl_update_memory  # noqa: E402

from components.core.data.builtin_task import write_jsonl  # noqa: E402
from components.core.data.tokenizers import BUILTIN_WORDS  # noqa: E402
from components.evaluate.config import EvalConfig  # noqa: E402
from components.evaluate.measures import bootstrap_interval, paired_difference  # noqa: E402
from components.evaluate.stage import run as evaluate  # noqa: E402
from components.shard import ShardConfig  # noqa: E402
from components.shard import run as run_shard  # noqa: E402
from pipelines.dag import params  # noqa: E402

RL_ALGORITHMS = ("ppo", "grpo", "rloo")
ALGORITHMS = (*RL_ALGORITHMS, "dpo")
MIB = 2**20


class StageRun(NamedTuple):
    """A training stage's output folder, printed summary and wall time."""

    output: str
    summary: dict[str, Any]
    seconds: float


def stage_flags(settings: dict[str, Any]) -> list[str]:
    """``--field=value`` flags of a stage's config fields."""
    return [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]


def run_stage(module: str, settings: dict[str, Any], paths: dict[str, str], logs: Path) -> StageRun:
    """``python -m components.<module>`` in a fresh process; its last stdout line is its summary."""
    path_flags = [arg for name, path in paths.items() for arg in (f"--{name}", path)]
    command = [sys.executable, "-m", f"components.{module}", *path_flags, *stage_flags(settings)]
    log = logs / f"{Path(paths['output']).name}.log"
    print(f"[bench] {Path(paths['output']).name}: running (log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as stderr:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}); see {log}")
    print(f"[bench] {Path(paths['output']).name}: done in {seconds:.1f} s", flush=True)
    return StageRun(paths["output"], json.loads(done.stdout.strip().splitlines()[-1]), seconds)


def shard_task(values: dict[str, Any], root: Path) -> str:
    """The built-in task generated and sharded into ``root``/shards, as the demo does."""
    pairs = str(root / "pairs.jsonl")
    write_jsonl(pairs, values["builtin_pairs"], seed=values["seed"])
    shard = params.stage_values("shard", values)
    shard["tokenizer"] = shard["tokenizer"] or BUILTIN_WORDS  # the task's own, as the demo's
    shards = str(root / "shards")
    run_shard(ShardConfig(**shard), [pairs], shards)
    return shards


def prepare(
    values: dict[str, Any], root: Path, shards: str = ""
) -> tuple[str, dict[str, StageRun]]:
    """The built-in task sharded (unless ``shards`` is), and the sft policy and reward model
    trained, as the demo does."""
    shards = shards or shard_task(values, root)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    runs = {}
    for stage in ("sft", "reward"):
        paths = {"shards": shards, "output": str(root / stage)}
        runs[stage] = run_stage(stage, params.stage_values(stage, values), paths, logs)
    return shards, runs


def train_algorithms(
    values: dict[str, Any],
    shards: str,
    base: dict[str, StageRun],
    root: Path,
    ppo_settings: dict[str, str] | None = None,
) -> dict[str, StageRun]:
    """Each algorithm from the same sft policy (the RL ones against the same reward model);
    ``ppo_settings``: PPOConfig fields over the pipeline's (``--ppo-set``)."""
    sft, reward, logs = base["sft"].output, base["reward"].output, root / "logs"
    runs = {}
    for algorithm in RL_ALGORITHMS:
        settings = {**params.stage_values("ppo", values), **(ppo_settings or {})}
        settings["algorithm"] = algorithm
        paths = {"shards": shards, "policy": sft, "reward": reward, "output": str(root / algorithm)}
        runs[algorithm] = run_stage("ppo", settings, paths, logs)
    paths = {"shards": shards, "policy": sft, "output": str(root / "dpo")}
    runs["dpo"] = run_stage("dpo", params.stage_values("dpo", values), paths, logs)
    return runs


def evaluate_against_sft(
    values: dict[str, Any], shards: str, base: dict[str, StageRun], policy: str, output: str
) -> dict[str, Any]:
    """The evaluate stage's summary of ``policy`` against the sft policy (demo settings)."""
    config = EvalConfig(**params.stage_values("evaluate", values))
    return evaluate(
        config, shards_dir=shards, policy_dir=policy, reference_dir=base["sft"].output,
        reward_dir=base["reward"].output, output=output,
    )  # fmt: skip


def update_memory(algorithm: str, runs: dict[str, StageRun], shards: str) -> dict[str, int]:
    """Per-device update memory of ``algorithm`` at the shapes its stage ran."""
    sft, reward = runs["sft"].output, runs["reward"].output
    if algorithm == "dpo":
        return dpo_step_memory(runs["dpo"].output, shards, sft)
    return rl_update_memory(runs[algorithm].output, shards, sft, reward)


def per_prompt(evaluation: str) -> dict[str, np.ndarray]:
    """Per eval prompt of the aligned policy (the evaluation's samples.jsonl): its mean gold
    reward, and the sums of its samples' KL to the sft policy and of their tokens."""
    rows = [
        json.loads(line) for line in (Path(evaluation) / "samples.jsonl").read_text().splitlines()
    ]
    prompts = max(row["prompt_index"] for row in rows) + 1
    sums = {key: np.zeros(prompts) for key in ("aligned_gold", "aligned_kl", "aligned_tokens")}
    counts = np.zeros(prompts)
    for row in rows:
        for key, column in sums.items():
            column[row["prompt_index"]] += row[key]
        counts[row["prompt_index"]] += 1
    return {"gold": sums["aligned_gold"] / counts, "kl": sums["aligned_kl"],
            "tokens": sums["aligned_tokens"]}  # fmt: skip


def _kl_per_token(kl: np.ndarray, tokens: np.ndarray) -> float:
    return float(kl.sum() / tokens.sum())


def kl_versus(algorithm: dict[str, np.ndarray], ppo: dict[str, np.ndarray]) -> dict[str, Any]:
    """KL per token of the algorithm and of PPO, each with its 95% interval, and their paired
    difference on the same prompts (prompts resampled together: percentile bootstrap)."""
    bootstrap = {"n_resamples": 1000, "confidence": 0.95, "seed": 0}

    def difference(kl, tokens, ppo_kl, ppo_tokens) -> float:
        return _kl_per_token(kl, tokens) - _kl_per_token(ppo_kl, ppo_tokens)

    figures = {}
    for name, run in (("algorithm", algorithm), ("ppo", ppo)):
        low, high = bootstrap_interval(_kl_per_token, run["kl"], run["tokens"], **bootstrap)
        figures[name] = {"value": _kl_per_token(run["kl"], run["tokens"]), "low": low, "high": high}
    columns = (algorithm["kl"], algorithm["tokens"], ppo["kl"], ppo["tokens"])
    low, high = bootstrap_interval(difference, *columns, **bootstrap)
    figures["difference"] = {"value": difference(*columns), "low": low, "high": high}
    return figures


def row_of(summary: dict[str, Any], memory: dict[str, int], run: StageRun) -> dict[str, Any]:
    """The table's figures of one algorithm."""
    gold = summary["gold"]
    return {
        "gold_gain": gold["difference"],
        "gold_win_rate": gold["win_rate"]["value"],
        "gold_win_rate_interval": [gold["win_rate"]["low"], gold["win_rate"]["high"]],
        # The old estimand: sample s of both policies, drawn with the same key, paired.
        "gold_win_rate_coupled": (gold["win_rate"].get("coupled") or {}).get("value"),
        "kl_per_token": summary["kl"]["per_token"],
        "kl_per_sequence": summary["kl"]["per_sequence"],
        "vs_best_of_n": summary["ppo_vs_best_of_n"],
        "vs_best_of_n_bound": summary["ppo_vs_best_of_n_bound"],
        "vs_best_of_n_interval": summary["ppo_vs_best_of_n_interval"],
        "vs_best_of_n_chord": summary["ppo_vs_best_of_n_chord"],
        "best_of_n_at_kl": summary["best_of_n_at_kl"],
        "vs_best_of_n_capped": summary["ppo_vs_best_of_n_capped"],
        "reward_model_win_rate": summary["win_rate"]["value"],
        "rollout_kl": rollout_kl(run.output),
        "stage_seconds": run.seconds,
        "update_memory_bytes": memory,
    }


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per algorithm."""
    lines = [
        f"{'algorithm':<9} {'gold gain [95% interval]':<26} {'gold win':>8} {'KL/token':>9} "
        f"{'vs BoN':>7} {'RM win':>7} {'stage s':>8} {'update MiB/dev':>14}"
    ]
    for name, row in rows.items():
        gain, ratio = row["gold_gain"], row["vs_best_of_n"]
        interval = f"{gain['value']:+.3f} [{gain['low']:+.3f}, {gain['high']:+.3f}]"
        versus = (
            "n/a" if ratio is None else f"{ratio:.2f}" + ("*" if row["vs_best_of_n_capped"] else "")
        )
        lines.append(
            f"{name:<9} {interval:<26} {row['gold_win_rate']:>8.3f} {row['kl_per_token']:>9.4f} "
            f"{versus:>7} {row['reward_model_win_rate']:>7.3f} {row['stage_seconds']:>8.1f} "
            f"{row['update_memory_bytes']['peak'] / MIB:>14.2f}"
        )
    return "\n".join(lines)


def targets(
    rows: dict[str, dict[str, Any]], versus_ppo: dict[str, dict], kl_vs_ppo: dict[str, dict]
) -> list[dict[str, Any]]:
    """The issue's targets, each with its figures and whether it is met. Gain and KL are judged
    alike, against PPO's 95% interval: gain at least its low end, KL at most its high end."""
    ppo = rows["ppo"]
    checks = []
    for name in ("grpo", "rloo"):
        row, paired = rows[name], versus_ppo[name]["difference"]
        gain, ppo_gain = row["gold_gain"]["value"], ppo["gold_gain"]
        checks.append(
            {
                "target": f"{name} reaches PPO's gold gain (at least its interval's low end)",
                "met": gain >= ppo_gain["low"],
                "figures": f"{gain:+.3f} vs PPO {ppo_gain['value']:+.3f} "
                f"[{ppo_gain['low']:+.3f}, {ppo_gain['high']:+.3f}]; point estimate "
                f"{'at or above' if gain >= ppo_gain['value'] else 'below'} PPO's; paired "
                f"{name} - PPO on the same prompts {paired['value']:+.3f} "
                f"[{paired['low']:+.3f}, {paired['high']:+.3f}]",
            }
        )
        kl, ppo_kl, kl_paired = row["kl_per_token"], kl_vs_ppo[name]["ppo"], kl_vs_ppo[name]
        kl_paired = kl_paired["difference"]
        checks.append(
            {
                "target": f"{name} at no more KL than PPO (at most its interval's high end)",
                "met": kl <= ppo_kl["high"],
                "figures": f"{kl:.4f} vs PPO {ppo_kl['value']:.4f} [{ppo_kl['low']:.4f}, "
                f"{ppo_kl['high']:.4f}] nats/token; point estimate "
                f"{'at or below' if kl <= ppo_kl['value'] else 'above'} PPO's; paired {name} - "
                f"PPO on the same prompts {kl_paired['value']:+.4f} [{kl_paired['low']:+.4f}, "
                f"{kl_paired['high']:+.4f}]",
            }
        )
        memory = row["update_memory_bytes"]["peak"]
        ppo_memory = ppo["update_memory_bytes"]["peak"]
        checks.append(
            {
                "target": f"{name} with less update memory than PPO",
                "met": memory < ppo_memory,
                "figures": f"{memory / MIB:.2f} vs PPO {ppo_memory / MIB:.2f} MiB per device "
                f"= {memory / ppo_memory:.2f}x",
            }
        )
    dpo = rows["dpo"]["gold_gain"]
    checks.append(
        {
            "target": "dpo's gold-gain interval lies above zero",
            "met": dpo["low"] > 0,
            "figures": f"{dpo['value']:+.3f} [{dpo['low']:+.3f}, {dpo['high']:+.3f}]",
        }
    )
    return checks


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set PARAM=VALUE ...``: pipeline parameters over the demo's (:func:`demo_values`)."""
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="PARAM=VALUE",
        help="pipeline parameters other than the demo's (the figures then are not the demo's)",
    )  # fmt: skip


def demo_values(overrides: list[str]) -> dict[str, Any]:
    """The pipeline's parameters: the demo's, with ``--set PARAM=VALUE`` overrides."""
    changed = dict(item.split("=", 1) for item in overrides)
    changed = {name: params.coerce(name, text) for name, text in changed.items()}
    return params.validate(changed, jax.local_device_count())


def machine() -> str:
    """The machine in words."""
    return (
        f"{os.cpu_count()}-core {platform.machine()} CPU, no accelerator (CPU only), "
        f"{jax.local_device_count()} virtual JAX devices"
    )


def run_seeds(
    values: dict[str, Any],
    shards: str,
    base: dict[str, StageRun],
    root: Path,
    seeds: list[int],
    ppo_settings: dict[str, str],
) -> tuple[dict[int, dict[str, StageRun]], dict[int, dict[str, dict]], dict[str, dict]]:
    """Every algorithm trained and evaluated per seed: the runs, the table's rows per seed,
    and the first seed's per-prompt figures (for the paired comparisons with PPO)."""
    runs: dict[int, dict[str, StageRun]] = {}
    rows: dict[int, dict[str, dict[str, Any]]] = {}
    prompts: dict[str, dict[str, np.ndarray]] = {}
    memory: dict[str, dict[str, int]] = {}
    for seed in seeds:
        folder = root / f"seed-{seed}"
        (folder / "logs").mkdir(parents=True, exist_ok=True)
        trained = train_algorithms({**values, "seed": seed}, shards, base, folder, ppo_settings)
        runs[seed] = {**base, **trained}
        rows[seed] = {}
        for name in ALGORITHMS:
            evaluation = str(folder / f"eval-{name}")
            print(f"[bench] seed {seed}: evaluating {name} against the sft policy", flush=True)
            policy = runs[seed][name].output
            summary = evaluate_against_sft(values, shards, base, policy, evaluation)
            if name not in memory:  # the shapes are the seeds' same
                memory[name] = update_memory(name, runs[seed], shards)
            rows[seed][name] = row_of(summary, memory[name], runs[seed][name])
            if seed == seeds[0]:
                prompts[name] = per_prompt(evaluation)
    return runs, rows, prompts


def _stage_seconds(runs: dict[int, dict[str, StageRun]]) -> dict[str, float]:
    return {
        f"{name}/seed-{seed}": run.seconds
        for seed, by_name in runs.items()
        for name, run in by_name.items()
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="", help="folder for every artifact (default: temp)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the RL and DPO stages")
    parser.add_argument(
        "--ppo-set", nargs="*", default=[], metavar="FIELD=VALUE",
        help="PPOConfig fields no pipeline parameter sets (e.g. kl_control=ziegler "
        "score_norm=data kl_coef=0.2: the controller and normalisation before issue 38)",
    )  # fmt: skip
    add_set_argument(parser)
    return parser


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    started = time.perf_counter()
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-algorithms-"))
    root.mkdir(parents=True, exist_ok=True)
    values = demo_values(args.set)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    print(f"[bench] {machine()}; artifacts in {root}", flush=True)
    shards, base = prepare(values, root)
    ppo_settings = dict(item.split("=", 1) for item in args.ppo_set)
    runs, rows, prompts = run_seeds(values, shards, base, root, seeds, ppo_settings)
    first = rows[seeds[0]]
    versus_ppo = {
        name: paired_difference(
            prompts[name]["gold"], prompts["ppo"]["gold"], n_resamples=1000, confidence=0.95, seed=0
        )
        for name in ALGORITHMS
    }
    kl_vs_ppo = {name: kl_versus(prompts[name], prompts["ppo"]) for name in ALGORITHMS}
    summary = over_seeds(rows)
    kl_target = params.stage_values("ppo", values)["kl_target"]
    checks = seed_targets(summary, kl_target, RL_ALGORITHMS)
    checks += targets(first, versus_ppo, kl_vs_ppo)
    seconds = time.perf_counter() - started
    print(
        f"\nbuilt-in task, {'settings ' + ' '.join(args.set) if args.set else 'demo settings'}"
        f"{' ppo ' + ' '.join(args.ppo_set) if args.ppo_set else ''}, "
        f"{machine()}; sft {base['sft'].seconds:.0f} s, "
        f"reward {base['reward'].seconds:.0f} s (accuracy "
        f"{base['reward'].summary.get('eval/accuracy', float('nan')):.3f})"
    )
    print(format_seed_table(summary, seeds))
    print(f"\nseed {seeds[0]}:")
    print(format_table(first))
    print(
        "gold gain and win rate, KL (k3, aligned samples) and RM win rate against the sft "
        "policy; train KL = the rollouts' KL per token after the first tenth of the run; "
        "vs BoN = gold gain / best-of-n's at the same KL on its any-n curve (* capped at "
        "the largest n); gold win = independent pairs, (coupled) = sample s with sample s of "
        "the same key, the old estimand; update MiB/dev = the compiled "
        "update's live bytes + frozen parameters resident"
    )
    for check in checks:
        print(f"{'PASS' if check['met'] else 'FAIL'}  {check['target']}: {check['figures']}")
    print(f"benchmark wall time {seconds:.0f} s")
    if args.json:
        record = {
            "machine": machine(),
            "settings": {k: v for k, v in values.items() if isinstance(v, int | float | str)},
            "seeds": seeds,
            "stage_seconds": _stage_seconds(runs),
            "rows": {str(seed): by_name for seed, by_name in rows.items()},
            "over_seeds": summary,
            "paired_gold_vs_ppo": {name: versus_ppo[name]["difference"] for name in ALGORITHMS},
            "kl_vs_ppo": kl_vs_ppo,
            "targets": checks,
            "seconds": seconds,
            "work_dir": str(root),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2, default=float) + "\n")
    return 0  # a missed target is a figure (FAIL above, "met" in the JSON), not an error


if __name__ == "__main__":
    sys.exit(main())
