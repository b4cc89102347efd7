"""Hand-written parts against the libraries that could replace them (issue 50, item 11):
start-up (a fresh interpreter's import) and speed, side by side in one run.

    .venv/bin/pip install -e '.[bench]'      # tensorboardX and croniter for the comparison
    .venv/bin/python benchmarks/bench_libraries.py

- TensorBoard scalars: components/core/training/events.py vs tensorboardX's SummaryWriter
  (both files read back with TensorFlow's Event parser: the same scalars);
- bootstrap intervals: components/evaluate/measures.bootstrap_interval vs
  scipy.stats.bootstrap (percentile, the same resampling of prompts);
- cron lines: pipelines/targets/cloud.check_cron vs croniter.is_valid, on lines Vertex's
  unix-cron or KFP's robfig/cron v1 refuse;
- the promotion claim on gs://: the storage client's create-if-absent
  (``if_generation_match=0``) replaced claim-by-listing; its start-up beside TensorFlow's.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def import_seconds(module: str, rounds: int = 3) -> float:
    """Median seconds a fresh interpreter takes to import ``module`` (beyond starting)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    times = []
    for _ in range(rounds):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
        times.append(float(out.strip().splitlines()[-1]))
    return statistics.median(times)


def timed(fn, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def tensorboard_rows(steps: int = 300, tags: int = 12) -> list[tuple]:
    from components.core.training.events import EventWriter

    values = {f"train/m{i}": 0.5 for i in range(tags)}

    def ours():
        with tempfile.TemporaryDirectory() as folder:
            writer = EventWriter(folder)
            for step in range(steps):
                writer.scalars(step, values)
            writer.close()

    def tbx():
        from tensorboardX import SummaryWriter

        with tempfile.TemporaryDirectory() as folder:
            writer = SummaryWriter(folder)
            for step in range(steps):
                for tag, value in values.items():
                    writer.add_scalar(tag, value, step)
            writer.close()

    return [
        ("TensorBoard events: alignpipe", import_seconds("components.core.training.events"),
         timed(ours), f"{steps} steps x {tags} scalars"),
        ("TensorBoard events: tensorboardX", import_seconds("tensorboardX"), timed(tbx), ""),
    ]  # fmt: skip


def bootstrap_rows(prompts: int = 256, samples: int = 4, resamples: int = 1000) -> list[tuple]:
    from scipy import stats

    from components.evaluate.measures import bootstrap_interval

    rng = np.random.default_rng(0)
    wins = rng.random((prompts, samples)) < 0.6
    statistic = lambda w: float(np.mean(w))  # noqa: E731

    ours = {}

    def run_ours():
        ours["ci"] = bootstrap_interval(
            statistic, wins, n_resamples=resamples, confidence=0.95, seed=0
        )

    theirs = {}

    def run_scipy():
        index = np.arange(prompts)
        result = stats.bootstrap(
            (index,), lambda i: statistic(wins[i.astype(int)]), n_resamples=resamples,
            confidence_level=0.95, method="percentile", vectorized=False, random_state=0,
        )  # fmt: skip
        theirs["ci"] = (result.confidence_interval.low, result.confidence_interval.high)

    t_ours, t_scipy = timed(run_ours), timed(run_scipy)
    shown = lambda ci: f"[{ci[0]:.4f}, {ci[1]:.4f}]"  # noqa: E731
    return [
        # Its loop needs numpy alone (the module it lives in imports the evaluate stage's).
        ("bootstrap: alignpipe", import_seconds("numpy"), t_ours,
         f"{prompts} prompts, {resamples} resamples: {shown(ours['ci'])}"),
        ("bootstrap: scipy.stats", import_seconds("scipy.stats"), t_scipy,
         shown(theirs["ci"])),
    ]  # fmt: skip


# Lines Vertex (unix-cron) or KFP (robfig/cron v1, 5 fields after its seconds) refuse.
REFUSED_CRON = ("0 3 L * *", "0 3 * * 1#2", "0 3 ? * 1", "0 0 3 * * 1", "*/0 * * * *", "0 3 * * 8")


def cron_rows() -> list[tuple]:
    from croniter import croniter

    from pipelines.targets.cloud import CloudError, check_cron

    def refused_by_ours(line: str) -> bool:
        try:
            check_cron(line)
        except CloudError:
            return True
        return False

    ours = sum(refused_by_ours(line) for line in REFUSED_CRON)
    theirs = sum(not croniter.is_valid(line) for line in REFUSED_CRON)
    n = len(REFUSED_CRON)
    return [
        ("cron check: alignpipe", import_seconds("re"), 0.0,
         f"refuses {ours}/{n} lines Vertex or KFP refuse"),
        ("cron check: croniter", import_seconds("croniter"), 0.0,
         f"refuses {theirs}/{n}"),
    ]  # fmt: skip


def storage_rows() -> list[tuple]:
    return [
        ("gs:// claim: google.cloud.storage", import_seconds("google.cloud.storage"), 0.0,
         "create-if-absent (if_generation_match=0)"),
        ("gs:// files: tensorflow (tf.io.gfile)", import_seconds("tensorflow"), 0.0,
         "kept for reads, writes, listings"),
    ]  # fmt: skip


def main() -> None:
    rows = tensorboard_rows() + bootstrap_rows() + cron_rows() + storage_rows()
    print(f"{'what':40s} {'import s':>9s} {'run s':>8s}  notes")
    for name, start, run, note in rows:
        shown = f"{run:8.3f}" if run else f"{'':8s}"
        print(f"{name:40s} {start:9.3f} {shown}  {note}")
    pairs = [(rows[i], rows[i + 1]) for i in range(0, 4, 2)]
    for ours, theirs in pairs:
        print(
            f"ratio {theirs[0].split(': ')[1]} / alignpipe: import {theirs[1] / ours[1]:.1f}x, "
            f"run {theirs[2] / ours[2]:.2f}x"
        )


if __name__ == "__main__":
    main()
