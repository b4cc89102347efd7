"""A user's own task end to end: TRL-format pairs, a Hugging Face tokenizer.json, a gold file.

What a user brings, made here without a download: preference pairs in TRL's explicit format
(``{"prompt", "chosen", "rejected"}`` JSONL) labelled by a Bradley-Terry draw on the gold
reward in ``benchmarks/user_task/gold.py``, a byte-level BPE ``tokenizer.json`` (the Llama
test fixture: 300 tokens) and ``--gold-reward benchmarks/user_task/gold.py:gold``. The whole
pipeline runs locally (``alignpipe run``); the figures come from the evaluation's eval.json.
Target (issue "PPO that aligns"): the gold gain's interval lies above zero.

    python benchmarks/bench_user_task.py [--pairs 3000] [--runs-dir /tmp/user-task-runs]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "user_task"))
from gold import COURTEOUS, CURT, gold  # noqa: E402

PEOPLE = ("teacher", "driver", "doctor", "baker", "clerk", "pilot", "farmer", "nurse")
THINGS = ("map", "bread", "ticket", "garden", "letter", "train", "window", "clock")
TEMPLATES = ("Ask the {p} about the {t}.", "Reply to the {p} about the {t}.")
FILLER = ("the", "a", "it", "is", "and", "we", "you", "i")


def reply(rng: random.Random) -> str:
    """A random reply of 2-7 words."""
    words = [rng.choice(COURTEOUS + CURT + FILLER) for _ in range(rng.randint(2, 7))]
    return " ".join(words).capitalize() + "."


def pairs(count: int, seed: int, beta: float = 8.0) -> list[dict[str, str]]:
    """TRL explicit-format pairs; the chosen reply is drawn as Bradley-Terry on the gold."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while len(rows) < count:
        prompt = rng.choice(TEMPLATES).format(p=rng.choice(PEOPLE), t=rng.choice(THINGS))
        a, b = reply(rng), reply(rng)
        ga, gb = gold(prompt, a), gold(prompt, b)
        if ga == gb:
            continue
        a_wins = rng.random() < 1 / (1 + math.exp(-beta * (ga - gb)))
        chosen, rejected = (a, b) if a_wins else (b, a)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--runs-dir", default="/tmp/alignpipe-user-task")
    args = parser.parse_args()
    root = Path(args.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in pairs(args.pairs, seed=0)))
    from pipelines.cli.main import main as alignpipe

    flags = [
        "run", "--runs-dir", str(root / "runs"), "--data-uri", str(data),
        "--tokenizer", str(REPO / "tests/fixtures/hf/llama/tokenizer.json"),
        "--gold-reward", f"{REPO / 'benchmarks/user_task/gold.py'}:gold",
    ]  # fmt: skip
    start = time.time()
    status = alignpipe(flags)
    seconds = time.time() - start
    found = sorted((root / "runs").glob("*/evaluate/evaluation/eval.json"), key=os.path.getmtime)
    if status or not found:
        print(f"user task: the pipeline failed (exit {status})")
        return 1
    summary = json.loads(found[-1].read_text())["summary"]
    gain, win = summary["gold"]["difference"], summary["gold"]["win_rate"]
    print(
        f"user task ({args.pairs} TRL-format pairs, HF BPE tokenizer, gold from a file), "
        f"{seconds:.0f} s: gold gain {gain['value']:+.3f} [{gain['low']:+.3f}, "
        f"{gain['high']:+.3f}], gold win rate {win['value']:.3f} [{win['low']:.3f}, "
        f"{win['high']:.3f}], KL {summary['kl']['per_token']:.4f} nats/token, "
        f"ppo_vs_best_of_n {summary.get('ppo_vs_best_of_n')}"
    )
    above = gain["low"] > 0
    print(f"target: gold gain interval above zero: {'met' if above else 'NOT met'}")
    return 0 if above else 1


if __name__ == "__main__":
    sys.exit(main())
