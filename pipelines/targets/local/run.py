"""Run the pipeline on this machine with kfp.local, caching on, and summarize the run.

The terminal gets one progress line per stage event and the summary; everything the tasks
print (executor inputs, Beam, Orbax, TensorFlow) goes to the run folder's ``run.log``
(run_log.py), and a failed task's own error ends the summary. Local inputs are checked
before any task runs (preflight.py).

Which stages ran and which came from the cache is read from two sources: kfp.local's
own task events (its log records: start, cache hit, finish, with times, for progress as
the run goes) and, as the ground truth, the run's folder — kfp.local makes a task's
folder only when it executes the task, so a cached task has none in this run.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import components
from components.core.entry import CPU_DEVICES_ENV, cpu_device_count
from pipelines import PIPELINE_NAME, run_record, stage_io
from pipelines.dag import params, preflight
from pipelines.dag.pipeline import build_pipeline
from pipelines.dag.stages import STAGE_TASKS, STAGES
from pipelines.targets.local import run_log
from pipelines.targets.local.result import TASK_STAGE, RunResult, StageRecord
from pipelines.targets.placement import LOCAL_IMAGE, Placement

LAST_RUN_FILE = "last_run.json"
# A task's progress line (components/core/training/metrics.py), and how often it is shown.
_PROGRESS = re.compile(r"^\s*\[(shard|sft|reward|ppo|dpo|evaluate)\] step (\d+)/(\d+) (.*)$")
PROGRESS_SECONDS = 10.0
PROMOTED_DIR = "promoted-policy"
_ANSI = run_log.ANSI
_EVENTS = (
    ("start", re.compile(r"^Executing task '?([\w-]+)'?")),
    ("cached", re.compile(r"^Task '?([\w-]+)'? cache hit")),
    ("finish", re.compile(r"^Task '?([\w-]+)'? finished with status (\w+)")),
)


class TaskWatcher(logging.Filter):
    """Follows kfp.local's task events on the root logger and prints one line per change
    to ``stream`` (the terminal's stdout as it was when the watcher was made)."""

    def __init__(self, echo: bool = True, stream: TextIO | None = None) -> None:
        super().__init__()
        self.records = {stage: StageRecord(stage) for stage in STAGES}
        self.echo = echo
        self.stream = stream or sys.stdout
        self._shown: dict[str, float] = {}  # when each stage's progress was last shown

    def progress(self, line: str) -> None:
        """A task's progress line (metrics.MetricsLogger's ``[stage] step N/T …``), shown at
        most every PROGRESS_SECONDS per stage, and at its last step."""
        match = _PROGRESS.match(line)
        if not match:
            return
        stage, step, total, rest = match.groups()
        now = time.monotonic()
        if step != total and now - self._shown.get(stage, -PROGRESS_SECONDS) < PROGRESS_SECONDS:
            return
        self._shown[stage] = now
        self.say(f"{stage}: step {step}/{total} {rest}")

    def filter(self, record: logging.LogRecord) -> bool:
        """Note a task event if the record is one; never drops the record."""
        message = _ANSI.sub("", record.getMessage())
        for event, pattern in _EVENTS:
            match = pattern.match(message)
            if match and match.group(1) in TASK_STAGE:
                self.records[TASK_STAGE[match.group(1)]].task = match.group(1)
                self._update(event, TASK_STAGE[match.group(1)], match.groups()[1:])
        return True  # observe only: kfp.local's own output stays as it is

    def _update(self, event: str, stage: str, extra: tuple[str, ...]) -> None:
        """Apply one task event to its stage's record and say so."""
        record = self.records[stage]
        if event == "start":
            record.status, record.started = "running", time.monotonic()
            self.say(f"{stage}: running")
        elif event == "cached":
            record.status = "cached"
            self.say(f"{stage}: from the cache")
        else:
            ok = extra and extra[0] == "SUCCESS"
            record.status = "ran" if ok else "failed"
            if record.started is not None:
                record.seconds = time.monotonic() - record.started
            self.say(f"{stage}: {'done' if ok else 'FAILED'} in {record.seconds or 0:.1f} s")

    def say(self, text: str) -> None:
        """Print a progress line (unless quiet)."""
        if self.echo:  # a write, not print: kfp.local indents print while a task streams
            self.stream.write(f"[alignpipe] {text}\n")
            self.stream.flush()


def failure_reasons(run_dir: Path | None) -> dict[str, str]:
    """What each failed task said (stage_io.failure_reason), by task name."""
    if run_dir is None or not run_dir.is_dir():
        return {}
    found = sorted(run_dir.glob(f"*/*/{stage_io.FAILURE_FILE}"))
    return {path.parent.parent.name: path.read_text().strip() for path in found}


def executed_tasks(run_dir: Path | None) -> set[str]:
    """Tasks kfp.local executed in this run: those with an executor output in the run folder."""
    if run_dir is None or not run_dir.is_dir():
        return set()
    return {p.parent.name for p in run_dir.glob("**/executor_output.json")}


def source_image() -> str:
    """The local tasks' image reference, named after the code they run.

    kfp.local caches a task by its spec, image reference included, and its runner runs the
    tasks with this checkout's code whatever the reference says: under the plain
    LOCAL_IMAGE a run after a code change took the stages from the cache of the old code.
    The tag is the sha256 of every Python file of ``components`` and ``pipelines``.
    """
    digest = hashlib.sha256()
    package_root = Path(components.__file__).resolve().parent.parent
    for folder in ("components", "pipelines"):
        for path in sorted((package_root / folder).rglob("*.py")):
            digest.update(path.relative_to(package_root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return f"{LOCAL_IMAGE}-src-{digest.hexdigest()[:16]}"


def run_local(
    values: dict[str, Any],
    *,
    runs_dir: str | os.PathLike = "runs",
    fresh_from: str | None = None,
    cpu_devices: int | None = None,
    echo: bool = True,
    sources: dict[str, str] | None = None,
) -> RunResult:
    """Run the pipeline with kfp.local under ``runs_dir``; caching on except ``fresh_from`` on.

    Parameters and local inputs are checked before anything runs (ParamError,
    PreflightError); the values are saved so that ``rerun`` repeats this run, and the run
    folder gets ``run.json`` (pipelines/run_record.py; ``sources``: where each value came
    from, a flag where none is said). The terminal gets progress lines (``echo``); the
    tasks' output goes to the run's log.
    """
    from kfp import local

    devices = _cpu_devices(cpu_devices)
    root = Path(runs_dir).resolve()
    if root.exists() and not root.is_dir():
        raise params.ParamError(f"--runs-dir {runs_dir} is a file; pass a folder for the runs")
    sources = {name: "flag" for name in values} | (sources or {})
    sources.setdefault("promoted_policy_uri", "default")
    values = {"promoted_policy_uri": str(root / PROMOTED_DIR), **values}
    placement = Placement(target="local", cpu_devices=devices, image=source_image())
    preflight.check(params.validate(values, placement.chips))
    pipeline = build_pipeline(placement, fresh_from)
    root.mkdir(parents=True, exist_ok=True)
    (root / LAST_RUN_FILE).write_text(json.dumps(values, indent=2, sort_keys=True))
    before = set(root.glob(f"{PIPELINE_NAME}-*"))
    local.init(
        runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), enable_caching=True
    )
    watcher = TaskWatcher(echo)
    # kfp.local names the run folder itself when the run starts; the log moves there at the end.
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H-%M-%S-%f")
    partial = root / f"running-{stamp}.log"
    watcher.say(f"full log: {partial} (moves into the run folder at the end)")
    started, outputs, error = time.monotonic(), {}, ""
    began = datetime.datetime.now().astimezone()
    try:
        with _watched(watcher), run_log.capture(partial, watcher.progress):
            outputs = dict(pipeline(**values).outputs)
    except RuntimeError as failure:
        error = str(failure)
    finally:
        run_dir = _run_folder(root, before, stamp)
        log = run_dir / run_log.LOG_FILE
        if partial.exists():
            partial.replace(log)
    executed = executed_tasks(run_dir)
    stages = _reconcile(watcher.records, executed)
    _write_record(run_dir, values, sources, began, stages, _ANSI.sub("", error))
    return RunResult(
        run_dir=run_dir,
        stages=stages,
        executed=executed,
        outputs=outputs,
        seconds=time.monotonic() - started,
        values=values,
        error=_ANSI.sub("", error),
        reasons=_reasons(run_dir, log) if error else {},
        log=log,
    )


@contextlib.contextmanager
def _watched(watcher: TaskWatcher) -> Iterator[None]:
    """The root logger at INFO (kfp.local reports cache hits there), read by ``watcher``."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addFilter(watcher)
    try:
        yield
    finally:
        logger.removeFilter(watcher)
        logger.setLevel(level)


def _cpu_devices(requested: int | None) -> int:
    """The virtual CPU devices of each training task: ``requested`` (--cpu-devices), set in
    the environment the tasks inherit, else what the environment says."""
    if requested is not None:
        if requested < 1:
            raise params.ParamError(f"--cpu-devices: {requested} must be at least 1")
        os.environ[CPU_DEVICES_ENV] = str(requested)
    try:
        return cpu_device_count()
    except ValueError as error:
        raise params.ParamError(str(error)) from None


def _write_record(
    run_dir: Path, values: dict, sources: dict, began: datetime.datetime, stages: dict,
    error: str,
) -> None:  # fmt: skip
    """The run's ``run.json`` (pipelines/run_record.py)."""
    stage_table = {name: {"status": s.status, "seconds": s.seconds} for name, s in stages.items()}
    record = run_record.record(
        values, sources, started=began, ended=datetime.datetime.now().astimezone(),
        outcome="failed" if error else "succeeded", stages=stage_table, error=error,
    )  # fmt: skip
    path = run_dir / run_record.RECORD_FILE
    path.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))


def _run_folder(root: Path, before: set[Path], stamp: str) -> Path:
    """The folder kfp.local made for this run; one named like it when it made none (the run
    failed before any task wrote an output), to hold the run's log."""
    new = sorted(p for p in set(root.glob(f"{PIPELINE_NAME}-*")) - before if p.is_dir())
    if new:
        return new[-1]
    folder = root / f"{PIPELINE_NAME}-{stamp}"
    folder.mkdir()
    return folder


def _reasons(run_dir: Path, log: Path) -> dict[str, str]:
    """Why each failed task failed: its failure file, else the exception in the run's log."""
    logged = run_log.task_errors(log.read_text(errors="replace"))
    found = {**logged, **failure_reasons(run_dir)}
    return {task: reason for task, reason in found.items() if task in TASK_STAGE}


def _reconcile(records: dict[str, StageRecord], executed: set[str]) -> dict[str, StageRecord]:
    """The watcher's records, corrected by the run folder (the ground truth of what ran)."""
    for stage, record in records.items():
        ran_tasks = [task for task in STAGE_TASKS[stage] if task in executed]
        ran = bool(ran_tasks)
        if ran:
            record.task = ran_tasks[0]
        if ran and record.status not in ("ran", "failed"):
            record.status = "ran"
        elif not ran and record.status in ("ran", "running"):
            record.status = "failed"
    return records


def run_folders(runs_dir: str | os.PathLike = "runs") -> list[Path]:
    """The run folders under ``runs_dir`` that hold a run record, oldest first."""
    found = Path(runs_dir).glob(f"{PIPELINE_NAME}-*/{run_record.RECORD_FILE}")
    return sorted(path.parent for path in found)


def read_record(runs_dir: str | os.PathLike, run: str) -> dict[str, Any]:
    """The run record of ``run``: a run folder's name under ``runs_dir``, or its path."""
    folder = Path(run) if Path(run).is_dir() else Path(runs_dir) / run
    path = folder / run_record.RECORD_FILE
    if not path.exists():
        known = ", ".join(p.name for p in run_folders(runs_dir)[-5:]) or "none"
        raise FileNotFoundError(
            f"--run {run}: no {run_record.RECORD_FILE} in {folder} (the latest runs under "
            f"{runs_dir}: {known}; `alignpipe runs` lists them)"
        )
    try:
        record = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not a run record ({error})") from None
    if not isinstance(record, dict) or "parameters" not in record:
        raise ValueError(f"{path} is not a run record: it has no parameters")
    return record


def run_values(runs_dir: str | os.PathLike, run: str) -> dict[str, Any]:
    """The parameters ``run`` ran with (its run.json), as rerun passes them again."""
    return run_record.values_of(read_record(runs_dir, run))


def last_values(runs_dir: str | os.PathLike = "runs") -> dict[str, Any]:
    """The parameters of the last run under ``runs_dir``."""
    path = Path(runs_dir) / LAST_RUN_FILE
    if not path.exists():
        raise FileNotFoundError(f"no earlier run under {runs_dir}: start one with `alignpipe run`")
    try:
        values = json.loads(path.read_text())
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        values = error
    if not isinstance(values, dict):
        raise ValueError(
            f"{path} does not hold a run's parameters ({values}); start a new run with "
            "`alignpipe run`"
        )
    return values
