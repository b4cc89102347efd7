"""Over-optimisation on the built-in task, seen without gold: where the proxy reward keeps
rising while gold peaks and falls, what the held-out reward model, checkpoint selection,
the gate and the length-controlled win rate make of it. Four settings (``--settings``):

- ``biased`` and ``biased-fast``, the gamed ones. The reward data is 1200 pairs labelled at
  the task's beta 10, but the annotators of the train split's prompts (whose labels the
  proxy and the ensemble learn) also credit "very" and "quite": gold plus ``BIAS``/6 for
  each use (``annotator``). The held-out and eval splits are labelled by gold, and
  the held-out model gets 1000 more gold-labelled pairs on its prompts (``heldout_pairs``;
  a held-out share from another annotator pool: with its 30% share alone, about 360 pairs,
  it rose with gold but barely fell with it). So the proxy has a flaw the held-out model
  has not, by construction: it stands for annotator pools with biases of their own, and
  makes systematic the error that the one gamed run of an earlier search found by chance
  (its proxy overrated "quite"). The reward models train 60 steps (about three passes over
  the proxy's ~600 pairs), not to saturation: a saturated proxy scores the biased and the
  all-positive responses alike, and PPO stays on the latter. ``biased`` runs PPO at 5e-5:
  gold peaks and falls, but the last policies of two seeds still beat the sft policy by
  gold. ``biased-fast`` runs it at 7e-5: gold falls below the sft policy's on two seeds.
- ``verbose``: a length hack, on a gold that length hurts. Gold is the task's sentiment less
  ``WORD_COST`` (0.25) a word (``_concise_gold.py``, given to the evaluate stage as a user's
  gold reward, ``gold_reward`` PATH.py:FUNCTION). The train split's annotators add
  ``LENGTH_CREDIT`` (0.35) a word to it once a response is kind (sentiment >= ``KIND``):
  among good answers they favour the longer (Singhal et al. 2023). The rest is
  ``biased-fast``'s. It asks whether the length-controlled win rate follows gold where the
  raw one does not.
- ``noisy``: the reward models learn from few, noisy labels (600 pairs at beta 3, 300 steps;
  the proxy's train split holds about 300). No seed of 0, 1 and 2 is gamed: the task's gold
  is 1.0 for any all-positive response, each proxy's top is a plateau that those responses
  reach (README: a beam search), and the policy climbs onto it through positive words. Its
  figures say what the monitors cost when nothing is gamed.

In all, PPO optimizes the proxy with no KL penalty (``kl_coef`` 0, ``adaptive_kl`` off) for
100 iterations: in the biased and verbose settings saved every 5 (at 1e-4 gold peaked at iteration
10-50 and selection kept 89-97% of the best gain), in the noisy one at 1e-4, saved every
10. Per seed:

1. the sft policy learns from the task's own 4000 pairs (``sft_data_uri``'s role); the
   reward data is sharded with ``heldout_fraction`` ``HELDOUT`` (the pipeline's
   ``heldout_reward``) and ``eval_fraction`` 0.2;
2. the reward stage trains the proxy on the train split, the held-out model on the heldout
   split and 2 more ensemble members (``ensemble_size`` 3);
3. PPO against the proxy saves every ``save_every`` iterations, keeping all, and outputs the
   policy its held-out model scored highest on the held-out prompts (``select_checkpoint
   heldout``, ``select_prompts`` 256);
4. every saved policy samples the eval prompts (``EVAL_SAMPLES`` each): its gold, proxy and
   held-out scores (z: each model's eval statistics) and its KL per token to the sft policy;
5. the evaluate stage judges the selected policy and the last one (the proxy judges; gold is
   measured beside): the gate's verdict, and the one a user without gold gets (the proxy's
   win rate in place of gold's), the raw and length-controlled win rates.

Printed per seed: the iterations where gold and the held-out model peak (the lag), gold's
drop from its peak while the proxy rose, the gold gain of the selected and the last
checkpoint as shares of the best one's, where ``heldout_patience`` 3, 10 and 20 would have
stopped, both verdicts and their win rates, and the last policy judged against the selected
one (raw and length-controlled win rates by the proxy and by gold); the JSON also holds
every save's raw and LC win rates over the sft policy (``curve``). Also the ensemble's
training as one reward task against three (the noisy setting's seed-0 data, each a process
of its own). ``--plot`` draws
the proxy, held-out and gold gains against KL (docs/overoptimisation.png).

    python benchmarks/bench_overoptimisation.py [--settings biased,biased-fast,verbose,noisy]
        [--seeds 0,1,2] [--plot PATH] [--json PATH] [--keep FOLDER] [--heldout-data-uri]

``--heldout-data-uri`` gives the held-out model's extra pairs as a user would: drawn on any
prompts, in a file of their own passed as ``heldout_data_uri`` (the shard stage puts them
all in the heldout split), instead of in the reward data on the heldout split's prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from components.core.entry import start_process  # noqa: E402

start_process()

import numpy as np  # noqa: E402
from _overopt_curve import EVAL_SAMPLES, curve, export_last  # noqa: E402
from _overopt_report import report  # noqa: E402
from _overopt_settings import (  # noqa: E402
    EVAL_FRACTION,
    HELDOUT,
    SETTINGS,
    SFT_PAIRS,
    Setting,
    annotator,
    heldout_pairs,
)

from components.core.data.builtin_task import generate_pairs  # noqa: E402
from components.core.data.tokenizers import BUILTIN_WORDS  # noqa: E402
from components.core.training.metrics import read_metrics  # noqa: E402
from pipelines.dag import params  # noqa: E402

REWARD = dict(batch_size=32, learning_rate=1e-3, ensemble_size=3)
PPO = dict(
    rollout_batch_size=64, kl_coef=0.0, adaptive_kl=False,
    score_norm="policy", keep_checkpoints=1000, kl_stop=1e9, max_restores=0,
)  # fmt: skip
PATIENCES = (3, 10, 20)


def write(path: Path, pairs: list[dict]) -> str:
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return str(path)


def prepare(root: Path, seed: int, setting: Setting, via_uri: bool) -> dict[str, str]:
    """Shards, the sft policy and the reward artifact (proxy, held-out, ensemble) of a seed.
    The held-out model's extra pairs go in the reward data on the heldout split's prompts,
    or, ``via_uri``, on any prompts in a file of their own given as ``heldout_data_uri``."""
    import components.sft as sft
    from components.reward import RewardConfig
    from components.reward import run as train_reward
    from components.shard import ShardConfig
    from components.shard import run as shard

    root.mkdir(parents=True, exist_ok=True)
    paths = {name: str(root / name) for name in ("sft_shards", "shards", "sft", "reward")}
    base = params.stage_values("shard", params.defaults())
    base.update(tokenizer=BUILTIN_WORDS, eval_fraction=EVAL_FRACTION, min_eval_pairs=0)
    sft_pairs = write(root / "sft.jsonl", list(generate_pairs(SFT_PAIRS, seed=seed)))
    shard(ShardConfig(**base), [sft_pairs], paths["sft_shards"])
    # The sft's draws (prompts and responses), labelled at the setting's beta.
    labels = annotator(setting)
    rm_pairs = list(generate_pairs(setting.pairs, seed=seed, beta=setting.beta, annotator=labels))
    extra = heldout_pairs(setting.heldout_pairs, seed, setting.beta, setting.gold_fn, via_uri)
    heldout_inputs = []
    if via_uri and extra:
        heldout_inputs.append(write(root / "heldout.jsonl", extra))
    else:
        rm_pairs += extra
    shard(
        ShardConfig(**{**base, "heldout_fraction": HELDOUT}), [write(root / "rm.jsonl", rm_pairs)],
        paths["shards"], heldout_inputs=heldout_inputs,
    )  # fmt: skip
    settings = params.stage_values("sft", params.defaults())
    settings.update(seed=seed, report_to="none")
    sft.run(sft.SFTConfig(**settings), paths["sft_shards"], paths["sft"])
    settings = params.stage_values("reward", params.defaults())
    settings.update(seed=seed, report_to="none", min_reward_accuracy=0.0, **REWARD)
    settings.update(steps=setting.reward_steps)
    train_reward(RewardConfig(**settings), paths["shards"], paths["reward"])
    return paths


def train(paths: dict[str, str], root: Path, seed: int, setting: Setting) -> str:
    from components.ppo import PPOConfig
    from components.ppo import run as ppo

    settings = params.stage_values("ppo", params.defaults())
    settings.update(seed=seed, report_to="none", **PPO)
    settings.update(
        save_every=setting.save_every, learning_rate=setting.learning_rate,
        iterations=setting.iterations,
    )  # fmt: skip
    output = str(root / "ppo")
    ppo(PPOConfig(**settings), paths["shards"], paths["sft"], paths["reward"], output)
    return output


def judge(
    paths: dict[str, str], policy: str, output: str, seed: int, gold: str, reference: str = ""
) -> dict[str, Any]:
    """The evaluate stage's verdict and win rates of ``policy`` against ``reference`` (the sft
    policy if empty)."""
    from components.evaluate.config import EvalConfig
    from components.evaluate.gate import decide
    from components.evaluate.stage import run as evaluate

    settings = params.stage_values("evaluate", params.defaults())
    # No KL penalty by design: every checkpoint is far from the sft policy, and max_kl and
    # max_anchor_kl would refuse them all; off (inf), the verdict is the other rules'.
    settings.update(seed=seed, report_to="none", max_kl=float("inf"), max_anchor_kl=float("inf"))
    settings.update(gold_reward=gold)
    config = EvalConfig(**settings)
    reference = reference or paths["sft"]
    summary = evaluate(config, paths["shards"], policy, reference, paths["reward"], output)
    record = json.loads(Path(output, "eval.json").read_text())
    part = summary["overoptimisation"]
    # What a user without gold is told: the same rules, the win rate the proxy's.
    blind = decide({k: v for k, v in summary.items() if k not in ("gold", "blessed")}, config)
    return {
        "blessed": summary["blessed"],
        "failed": [reason for reason in record["reasons"] if reason.endswith("fail")],
        "blessed_without_gold": blind.blessed,
        "failed_without_gold": [reason for reason in blind.reasons if reason.endswith("fail")],
        "win_rate": summary["win_rate"]["value"],
        "lc_win_rate": (summary.get("lc_win_rate") or {}).get("value"),
        "gold_win_rate": summary["gold"]["win_rate"]["value"],
        "gold_lc_win_rate": (summary["gold"].get("lc_win_rate") or {}).get("value"),
        "heldout_gain": part["heldout_gain"]["difference"]["value"],
        "gap": part["gap"],
        "disagreement": part["disagreement"]["ratio"],
        "length_ratio": part["length_ratio"],
    }


def early_stop(output: str, patience: int) -> int | None:
    """Where ``heldout_patience`` ``patience`` would have stopped the run (its rollouts), at
    the default ``heldout_tolerance``."""
    from components.ppo import PPOConfig
    from components.ppo.monitors import OveroptTracker

    tracker = OveroptTracker(patience, heldout=True, tolerance=PPOConfig().heldout_tolerance)
    for row in read_metrics(output):
        if "overopt/heldout_score" in row:
            iteration = int(row["step"]) - 1  # logged at step k + 1: iteration k's rollout
            if tracker.observe(iteration, row):
                return iteration
    return None


def figures(rows: list[dict], status: dict, output: str) -> dict[str, Any]:
    gold = np.array([row["gold"] for row in rows])
    iterations = [row["iteration"] for row in rows]
    peak, held_peak = int(np.argmax(gold)), int(np.argmax([row["heldout"] for row in rows]))
    start, best = gold[0], gold[peak] - gold[0]
    selected = int(status["selected_checkpoint"]["iteration"])
    at = {row["iteration"]: row for row in rows}
    return {
        "gold_peak": iterations[peak],
        "heldout_peak": iterations[held_peak],
        "lag": iterations[held_peak] - iterations[peak],
        "gold_drop": float(gold[peak] - gold[-1]),
        "proxy_rise_after_gold_peak": rows[-1]["proxy"] - rows[peak]["proxy"],
        "selected": selected,
        "selected_share": float((at[selected]["gold"] - start) / best),
        "last_share": float((gold[-1] - start) / best),
        "early_stop": {patience: early_stop(output, patience) for patience in PATIENCES},
    }


def ensemble_timing(root: Path) -> dict[str, float]:
    """One reward task training an ensemble of 3 against 3 tasks of one model each (a
    process each), on the reward data of ``root`` sharded without a heldout split (so each
    task trains exactly its own models)."""
    from components.shard import ShardConfig
    from components.shard import run as shard

    base = params.stage_values("shard", params.defaults())
    base.update(tokenizer=BUILTIN_WORDS, eval_fraction=EVAL_FRACTION, min_eval_pairs=0)
    shards = str(root / "timing_shards")
    shard(ShardConfig(**base), [str(root / "rm.jsonl")], shards)
    settings = params.stage_values("reward", params.defaults())
    settings.update(report_to="none", min_reward_accuracy=0.0, **REWARD)
    settings.update(steps=SETTINGS["noisy"].reward_steps)

    def task(output: str, **changes: Any) -> float:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**settings, **changes}.items()]
        command = [sys.executable, "-m", "components.reward", "--shards", shards,
                   "--output", output, *flags]  # fmt: skip
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        return time.perf_counter() - start

    one = task(str(root / "timing_one"), ensemble_size=3)
    three = sum(task(str(root / f"timing_{i}"), ensemble_size=1, seed=i) for i in range(3))
    return {"one_task_s": one, "three_tasks_s": three}


def run(
    setting: Setting, seeds: list[int], folder: Path, timing: bool, via_uri: bool
) -> tuple[dict, Any]:
    """Every seed's curve, figures and verdicts under ``setting``; the ensemble timing on
    the first seed's data if ``timing``."""
    results: dict[int, dict[str, Any]] = {}
    timed = None
    for seed in seeds:
        root = folder / f"seed{seed}"
        start = time.perf_counter()
        paths = prepare(root, seed, setting, via_uri)
        output = train(paths, root, seed, setting)
        status = json.loads(Path(output, "ppo_status.json").read_text())
        rows = curve(paths, output, seed, setting.gold_fn)
        last = export_last(paths, output, root)
        verdicts = {
            "selected": judge(paths, output, str(root / "eval_selected"), seed, setting.gold),
            "last": judge(paths, last, str(root / "eval_last"), seed, setting.gold),
        }
        # The last policy against the selected one: which the proxy, at any length and at
        # equal length, and gold prefer.
        head_to_head = judge(paths, last, str(root / "eval_last_vs_selected"), seed,
                             setting.gold, reference=output)  # fmt: skip
        results[seed] = {
            "curve": rows, "figures": figures(rows, status, output), "verdicts": verdicts,
            "last_vs_selected": head_to_head,
            "seconds": time.perf_counter() - start,
        }  # fmt: skip
        if timing and timed is None:
            timed = ensemble_timing(root)
    return results, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"of: {', '.join(SETTINGS)}")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (0,1,2)")
    parser.add_argument("--plot", default="", help="draw the gains against KL into this PNG")
    parser.add_argument("--json", default="", help="also write every figure to this file")
    parser.add_argument("--skip-timing", action="store_true", help="no ensemble timing")
    parser.add_argument("--keep", default="", help="train in this folder and keep its runs")
    parser.add_argument(
        "--heldout-data-uri", action="store_true",
        help="give the held-out model's extra pairs as a user would: on any prompts, in a file "
        "of their own passed as heldout_data_uri (default: in the reward data, on the heldout "
        "split's prompts)",
    )  # fmt: skip
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        parser.error(f"--settings: unknown {unknown}; pick from {sorted(SETTINGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    timing = None
    with contextlib.ExitStack() as stack:
        folder = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        for name in names:
            timed = not args.skip_timing and name == "noisy"
            results[name], found = run(
                SETTINGS[name], seeds, Path(folder) / name, timed, args.heldout_data_uri
            )
            timing = timing or found
    for name in names:
        print(
            f"\n{name}: built-in task, {SETTINGS[name].about()} (heldout_fraction {HELDOUT}"
            f"{'; the extra pairs on any prompts, as heldout_data_uri' * args.heldout_data_uri}); "
            f"ppo kl_coef 0; eval prompts, {EVAL_SAMPLES} samples each"
        )
        report(results[name], PATIENCES)
    if timing:
        print(
            f"ensemble of 3 and the held-out model in one reward task: {timing['one_task_s']:.0f}"
            f" s; 3 reward tasks of one model each: {timing['three_tasks_s']:.0f} s"
        )
    if args.plot:
        from _overopt_plot import plot

        plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"results": results, "timing": timing}, indent=2))


if __name__ == "__main__":
    main()
