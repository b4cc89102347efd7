"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases, MLflow, Vertex AI
Experiments (TensorBoard event files are ``MetricsLogger``'s own, written without TensorFlow).

``report_to`` names them as TRL's ``TrainingArguments.report_to`` does: a comma-separated
list, ``none`` for none, ``all`` for every one installed. Names follow the Hugging Face
trainers' callbacks, which TRL logs through: a training figure ``loss`` is ``train/loss``, an
evaluation figure ``eval/accuracy`` stays as it is (:func:`tracked_name`).

Each stage is one tracker run, named ``<group>-<stage>``: the group is the pipeline run (the
folder above the task's own in its artifact URI, on kfp.local and Vertex alike), so W&B groups
a run's stages, MLflow tags them and Vertex names them alike. A task resumed from its
checkpoint continues the same tracker run (W&B ``resume="allow"`` with an id from the name,
MLflow by the ``alignpipe.run`` tag, Vertex ``start_run(resume=True)``).

Where each writes is the tracker's own convention, read from its environment: ``WANDB_MODE``
(``offline`` writes under ``WANDB_DIR``, else ``<output>/wandb``), ``MLFLOW_TRACKING_URI``,
Vertex's project and region from ``aiplatform.init``'s defaults (the task's service account on
Vertex). The project (W&B), experiment (MLflow, Vertex) is ``tracker_project``; Vertex logs
time series to ``vertex_tensorboard`` ('' = the experiment's default backing TensorBoard).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

TENSORBOARD = "tensorboard"
# tracker → (module it imports, the pip extra that installs it)
EXTERNAL = {
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "vertex": ("google.cloud.aiplatform", "cloud"),
}
TRACKERS = (TENSORBOARD, *EXTERNAL)
# Vertex AI experiment run and experiment names: lowercase letters, digits and dashes.
VERTEX_NAME = re.compile(r"[^a-z0-9-]+")


def parse_report_to(text: str) -> tuple[str, ...]:
    """The trackers ``report_to`` names, in order; ``none`` = none, ``all`` = every one
    installed (TRL's meaning). Raises ValueError naming the unknown ones."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    if names == ("all",):
        return tuple(t for t in TRACKERS if t == TENSORBOARD or installed(t))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"report_to: unknown tracker {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(TRACKERS)} (comma-separated), all, or none"
        )
    return names


def installed(tracker: str) -> bool:
    """Whether ``tracker``'s package can be imported here."""
    if tracker == TENSORBOARD:
        return True
    module = EXTERNAL[tracker][0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package (google.cloud)
        return False


def require_installed(names: tuple[str, ...]) -> None:
    """Raises ValueError naming each tracker whose package is missing, and its extra."""
    missing = [n for n in names if not installed(n)]
    if missing:
        fixes = ", ".join(f"{n}: pip install 'alignpipe[{EXTERNAL[n][1]}]'" for n in missing)
        raise ValueError(f"report_to: {', '.join(missing)} not installed here ({fixes})")


def tracked_name(name: str) -> str:
    """A metric's name in the trackers: the Hugging Face trainers' ``train/`` prefix on
    training figures (``loss`` → ``train/loss``, ``objective/kl`` → ``train/objective/kl``),
    evaluation figures (``eval/…``) as they are."""
    return name if name.startswith("eval/") else f"train/{name}"


def run_id_of(artifact_uri: str) -> str:
    """The run an output artifact belongs to: the folder two levels above it, as kfp.local
    (``runs/<run>/evaluate/evaluation``) and Vertex (``<root>/<project>/<job>/<task>/…``)
    lay them out; '' when it has no such parents."""
    parts = [p for p in artifact_uri.rstrip("/").split("/") if p]
    return parts[-3] if len(parts) >= 3 else ""


@dataclasses.dataclass(frozen=True)
class TrackerRun:
    """What every tracker is told of one stage's run."""

    stage: str
    group: str
    project: str
    params: Mapping[str, Any]
    output: str
    resumed: bool = False
    vertex_tensorboard: str = ""

    @property
    def name(self) -> str:
        return f"{self.group}-{self.stage}"

    @property
    def key(self) -> str:
        """A stable id of this run (W&B's run id, MLflow's tag): a resumed task finds it."""
        return hashlib.sha256(f"{self.name}\0{self.output}".encode()).hexdigest()[:16]


class WandbTracker:
    """Weights & Biases: ``wandb.init`` (project, group, name, config), ``run.log`` by step."""

    def __init__(self, run: TrackerRun) -> None:
        import wandb

        local = "://" not in run.output
        folder = os.environ.get("WANDB_DIR") or (
            os.path.join(run.output, "wandb") if local else tempfile.mkdtemp(prefix="wandb-")
        )
        os.makedirs(folder, exist_ok=True)
        self._run = wandb.init(
            project=run.project, group=run.group, name=run.name, id=run.key, resume="allow",
            job_type=run.stage, config=dict(run.params), dir=folder,
        )  # fmt: skip

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """MLflow: one run per stage in experiment ``project``, tagged with the pipeline run."""

    def __init__(self, run: TrackerRun) -> None:
        import mlflow

        self._mlflow = mlflow
        experiment = mlflow.set_experiment(run.project)
        found = mlflow.search_runs(
            experiment_ids=[experiment.experiment_id],
            filter_string=f"tags.`alignpipe.run` = '{run.key}'",
            output_format="list",
            max_results=1,
        )
        tags = {
            "alignpipe.run": run.key,
            "alignpipe.group": run.group,
            "alignpipe.stage": run.stage,
        }
        self._run = mlflow.start_run(
            run_id=found[0].info.run_id if found else None, run_name=run.name, tags=tags
        )
        if not found:  # a resumed run's parameters are logged already (MLflow refuses changes)
            mlflow.log_params({k: _param(v) for k, v in run.params.items()})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


class VertexTracker:
    """Vertex AI Experiments: ``aiplatform.init(experiment=…)``, ``start_run``,
    ``log_params``, ``log_time_series_metrics`` (its backing TensorBoard), ``end_run``."""

    def __init__(self, run: TrackerRun) -> None:
        from google.cloud import aiplatform

        self._aiplatform = aiplatform
        aiplatform.init(
            experiment=vertex_name(run.project),
            experiment_tensorboard=run.vertex_tensorboard or None,
        )
        aiplatform.start_run(vertex_name(run.name), resume=run.resumed)
        if not run.resumed:
            aiplatform.log_params({k: _param(v) for k, v in run.params.items()})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._aiplatform.log_time_series_metrics(dict(metrics), step=step)

    def close(self) -> None:
        self._aiplatform.end_run()


OPENERS = {"wandb": WandbTracker, "mlflow": MlflowTracker, "vertex": VertexTracker}


def vertex_name(text: str) -> str:
    """``text`` as a Vertex experiment or run name: lowercase, [a-z0-9-], at most 128."""
    name = VERTEX_NAME.sub("-", text.lower()).strip("-")[:128]
    return name or "alignpipe"


def _param(value: Any) -> str | int | float:
    """A parameter value the trackers take (Vertex and MLflow: str, int or float)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return str(value)
    return value


class Trackers:
    """The external trackers one stage reports to; their names are :func:`tracked_name`'s."""

    def __init__(self, names: tuple[str, ...], run: TrackerRun) -> None:
        external = [n for n in names if n != TENSORBOARD]
        require_installed(tuple(external))
        self._open = [OPENERS[n](run) for n in external]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        named = {tracked_name(k): float(v) for k, v in metrics.items()}
        for tracker in self._open:
            tracker.log(step, named)

    def close(self) -> None:
        for tracker in self._open:
            tracker.close()
        self._open = []
