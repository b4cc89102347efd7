"""Training metrics: ``metrics.jsonl``, TensorBoard event files, the experiment trackers
``report_to`` names (``trackers.py``) and a progress line.

Only process 0 writes; the others keep the latest values so ``summary()``
answers everywhere. Resumed runs append to the same ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np

from components.core import fileio
from components.core.training import trackers
from components.core.training.events import EventWriter

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _as_float(value: Any) -> float:
    return float(np.asarray(value).mean())


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# What a progress line shows first, per stage: the loss; the reward model's accuracy; RL's
# normalized score and its KL per token (with reward functions: their total and the host
# seconds they took); DPO's loss and its preference accuracy.
HEADLINES = {
    "sft": ("loss",),
    "reward": ("accuracy", "loss"),
    "ppo": ("objective/scores", "objective/kl_per_token", "reward", "time/reward_functions_s"),
    "dpo": ("loss", "rewards/accuracies"),
}


class MetricsLogger:
    """Appends one JSON line per :meth:`log` call, writes TensorBoard scalars, shows progress."""

    def __init__(
        self,
        out_dir: str,
        *,
        total_steps: int,
        stage: str,
        tensorboard: bool = True,
        print_every: int = 10,
        stream: TextIO | None = None,
        resume_step: int | None = None,
        config: Any = None,
    ) -> None:
        """``resume_step``: the checkpoint a resumed run starts from; records logged after
        it by the killed run are dropped, so ``metrics.jsonl`` has each step once.
        ``config``: the stage's config (``TrackingSettings`` fields): the trackers it
        reports to, its fields their run's parameters; None = TensorBoard only."""
        import jax

        self.out_dir, self.total_steps, self.stage = out_dir, total_steps, stage
        self.print_every = max(print_every, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.is_writer = jax.process_index() == 0
        names = (trackers.TENSORBOARD,)
        if config is not None:
            names = trackers.parse_report_to(config.report_to)
        self.tensorboard = tensorboard and self.is_writer and trackers.TENSORBOARD in names
        self._latest: dict[str, float] = {}
        self._last_step: int | None = None
        self._start_time = time.time()
        self._start_step: int | None = None
        self._logs = 0
        self._tb_writer = None
        self._handle = None
        if self.is_writer:
            fileio.makedirs(out_dir)
            # Local files stay open for appends; remote ones are re-written at close.
            self._path = fileio.join(out_dir, METRICS_FILE)
            self._lines: list[str] = []
            if resume_step is not None:
                self._keep_up_to(resume_step)
            if "://" not in out_dir:
                self._handle = open(self._path, "a", encoding="utf-8")
        self._trackers = None
        if self.is_writer and config is not None:
            run = trackers.TrackerRun(
                stage=stage,
                group=trackers.run_id_of(out_dir) or "alignpipe",
                project=config.tracker_project,
                params=dataclasses.asdict(config),
                output=out_dir,
                resumed=bool(resume_step),
                vertex_tensorboard=config.vertex_tensorboard,
            )
            self._trackers = trackers.Trackers(names, run)

    def _keep_up_to(self, step: int) -> None:
        """Rewrite ``metrics.jsonl`` without the records after ``step``."""
        kept = [r for r in _read_lines(self.out_dir) if r.get("step", 0) <= step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        fileio.write_text(self._path, text)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (scalars or arrays, averaged) at ``step``."""
        values = {name: _as_float(value) for name, value in metrics.items()}
        self._latest.update(values)
        self._last_step = step
        if self._start_step is None:
            self._start_step, self._start_time = step, time.time()
        self._logs += 1
        if not self.is_writer:
            return
        line = json.dumps({"step": int(step), "time": time.time(), "stage": self.stage, **values})
        if self._handle is not None:
            self._handle.write(line + "\n")
            self._handle.flush()
        else:
            self._lines.append(line)
        if self.tensorboard:
            self._write_tensorboard(step, values)
        if self._trackers is not None:
            self._trackers.log(step, values)
        self._progress(step, values)

    def event(self, step: int, name: str, **details: Any) -> None:
        """Record an event (e.g. a guard restoration) at ``step``: a line with ``"event"`` and
        no metrics, which :func:`read_metrics` skips and :func:`read_events` returns."""
        if not self.is_writer:
            return
        line = json.dumps(
            {"step": int(step), "time": time.time(), "stage": self.stage, "event": name, **details}
        )
        if self._handle is not None:
            self._handle.write(line + "\n")
            self._handle.flush()
        else:
            self._lines.append(line)

    def _write_tensorboard(self, step: int, values: Mapping[str, float]) -> None:
        if self._tb_writer is None:
            self._tb_writer = EventWriter(fileio.join(self.out_dir, TENSORBOARD_DIR))
        # The trackers' names (train/loss, eval/accuracy), as the Hugging Face trainers write.
        named = {trackers.tracked_name(name): v for name, v in values.items()}
        self._tb_writer.scalars(step, named)

    def _progress(self, step: int, values: Mapping[str, float]) -> None:
        # A live line on a terminal; in logs (not a TTY) only every print_every calls.
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        if not is_tty and self._logs % self.print_every and step != self.total_steps:
            return
        elapsed = time.time() - self._start_time
        done = step - (self._start_step or 0)
        rate = done / elapsed if elapsed > 0 and done > 0 else float("nan")
        eta = (self.total_steps - step) / rate if rate and rate > 0 else float("nan")
        # The stage's headline figures first (HEADLINES), then the others, six in all.
        first = [k for k in HEADLINES.get(self.stage, ()) if k in values]
        keys = (first + [k for k in values if k not in first])[:6]
        shown = " ".join(f"{k}={values[k]:.4g}" for k in keys)
        text = (
            f"[{self.stage}] step {step}/{self.total_steps} {rate:.2f} steps/s "
            f"eta {_duration(eta)} {shown}"
        )
        self.stream.write(("\r" + text) if is_tty else (text + "\n"))
        self.stream.flush()

    def summary(self) -> dict[str, float]:
        """The latest value of every metric (for KFP ``Metrics``), plus the step reached."""
        result = dict(self._latest)
        if self._last_step is not None:
            result["step"] = float(self._last_step)
        return result

    def close(self) -> None:
        """Flush and close the files."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        elif self.is_writer and self._lines:
            previous = fileio.read_text(self._path) if fileio.exists(self._path) else ""
            fileio.write_text(self._path, previous + "\n".join(self._lines) + "\n")
            self._lines = []
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None
        if self.is_writer and hasattr(self.stream, "isatty") and self.stream.isatty():
            self.stream.write("\n")

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_lines(out_dir: str) -> list[dict[str, Any]]:
    """Every line of a ``metrics.jsonl``, metrics and events."""
    path = fileio.join(out_dir, METRICS_FILE)
    if not fileio.exists(path):
        return []
    return [json.loads(line) for line in fileio.read_text(path).splitlines() if line.strip()]


def read_metrics(out_dir: str) -> list[dict[str, Any]]:
    """The metric records of a ``metrics.jsonl``, one per step logged (events left out)."""
    return [record for record in _read_lines(out_dir) if "event" not in record]


def read_events(out_dir: str) -> list[dict[str, Any]]:
    """The events of a ``metrics.jsonl`` (``MetricsLogger.event``), in order."""
    return [record for record in _read_lines(out_dir) if "event" in record]
