"""Vertex training tasks as custom jobs: the TPU worker pool KFP's resource spec cannot say.

KFP's task resources name an accelerator type and count, not a machine type or a TPU
topology, and Vertex needs both for TPU v5e and later. So each training task of a compiled
Vertex pipeline is rewritten the way Google Cloud Pipeline Components'
``create_custom_training_job_from_component`` does it (GCPC 2.22, ``v1/custom_job``): the
task runs GCPC's custom-job launcher, whose ``--payload`` is a ``CustomJob`` with one
worker pool (machine type, ``tpu_topology``) whose container is the task's own image,
command and arguments. The launcher creates the job, waits for it and cancels it when the
task is cancelled; the stage inside writes its outputs itself (``/gcs`` is mounted on the
job's workers), exactly as it would in the task's own container.

A multi-host slice is the same single pool: Vertex's TPU pools take exactly one replica
("When you use a TPU VM ..., you must only use a single worker pool ... and configure this
worker pool to use only one replica", configure-compute, TPUs), and the topology names the
VMs (``ct5lp-hightpu-4t`` with ``4x4``: four VMs), each of which runs the container. The
hosts join with ``jax.distributed.initialize()`` and no arguments (JAX reads the worker
number and the workers' addresses from the TPU VM metadata); ``ALIGNPIPE_TPU_HOSTS`` on the
container says that the slice has several hosts, and how many.

The spec is generated here rather than through GCPC's package: GCPC 2.22 (the newest)
requires ``google-cloud-aiplatform<2`` and this project uses 2.x. GCPC 2.22 also has no
``tpu_topology`` argument; the worker pool here sets it in ``machine_spec``.

Every job sets ``scheduling``: ``restart_job_on_worker_restart`` (one restarted VM of a
multi-host slice restarts the whole job, from its checkpoints, instead of leaving the other
hosts blocked in a collective) and a ``timeout`` per stage (``STAGE_TIMEOUT_H``) instead of
Vertex's 7 days. The launcher starts through ``custom_job_retry.py`` (beside this module), so
that a retried task creates a new job rather than re-polling the one that failed.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from pipelines.targets.vertex import custom_job_retry

# The launcher image of GCPC 2.22.0 (google_cloud_pipeline_components/_image.py). It only
# creates and polls the job: the stage's code runs in the training image. Bound by tag: GCPC
# publishes no digest for it (not in _image.py, its release notes or its compiled samples),
# and none is quoted here that could not be checked against a source.
LAUNCHER_IMAGE = "gcr.io/ml-pipeline/google-cloud-pipeline-components:2.22.0"
LAUNCHER_MODULE = custom_job_retry.GCPC_LAUNCHER
# Each training job's bound, in hours (Vertex's default is 7 days). Bounds, not measurements
# (no TPU has run these stages): a hung slice costs at most this, and a healthy stage cut
# short loses only the steps since its last checkpoint, which the retried task resumes from.
# PPO, which also generates its rollouts, gets twice the others; evaluate only samples.
STAGE_TIMEOUT_H = {"sft": 24.0, "reward": 24.0, "dpo": 24.0, "ppo": 48.0, "evaluate": 12.0}
OTHER_TIMEOUT_H = 1.0  # any other task placed as training (the smoke check)
# Vertex placeholders, resolved when the task starts (GCPC's _placeholders.py).
PROJECT = "{{$.pipeline_google_cloud_project_id}}"
LOCATION = "{{$.pipeline_google_cloud_location}}"
# The job runs as the pipeline run's service account (unset: the default compute one);
# left empty it would run as the Vertex AI Custom Code Service Agent instead.
SERVICE_ACCOUNT = "{{$.pipeline_service_account}}"
# The executor input is substituted into a JSON string (the payload): escaped once.
EXECUTOR_INPUT = "{{$}}"
EXECUTOR_INPUT_IN_JSON = "{{$.json_escape[1]}}"
GCP_RESOURCES = "gcp_resources"  # the output Vertex reads to link and cancel the job
# Set on training tasks by targets.place: marks the executors rewritten here.
ROLE_ENV = "ALIGNPIPE_ROLE"


def worker_pool(container: dict[str, Any], machine_type: str, tpu_topology: str) -> dict[str, Any]:
    """The TPU worker pool: a ``tpu_topology`` slice of ``machine_type`` VMs, each running
    ``container`` (one replica: Vertex runs it on every VM of a multi-host slice)."""
    return {
        "machine_spec": {"machine_type": machine_type, "tpu_topology": tpu_topology},
        "replica_count": 1,
        "container_spec": {
            "image_uri": container["image"],
            "command": _escaped(container.get("command", [])),
            "args": _escaped(container.get("args", [])),
            "env": [dict(e) for e in container.get("env", [])],
        },
    }


def _escaped(parts: list[str]) -> list[str]:
    """``parts`` with the executor-input placeholder in its JSON-escaped form."""
    return [EXECUTOR_INPUT_IN_JSON if part == EXECUTOR_INPUT else part for part in parts]


def scheduling(stage: str, timeout_h: float = 0.0) -> dict[str, Any]:
    """The job's ``Scheduling``: restart the whole job when a worker restarts, and end it
    after ``timeout_h`` hours (0: the stage's ``STAGE_TIMEOUT_H``)."""
    hours = timeout_h or STAGE_TIMEOUT_H.get(stage, OTHER_TIMEOUT_H)
    return {"restart_job_on_worker_restart": True, "timeout": f"{round(hours * 3600)}s"}


def custom_job(
    name: str, pool: dict[str, Any], labels: dict[str, str], schedule: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``CustomJob`` payload of the launcher (fields as aiplatform_v1.types.CustomJob)."""
    job_spec: dict[str, Any] = {"worker_pool_specs": [pool], "service_account": SERVICE_ACCOUNT}
    if schedule:
        job_spec["scheduling"] = schedule
    return {"display_name": name, "job_spec": job_spec, "labels": labels}


def launcher(payload: dict[str, Any]) -> dict[str, Any]:
    """The executor container that creates the custom job and waits for it (through
    ``custom_job_retry``, whose source is the command: GCPC's image has none of ours)."""
    return {
        "image": LAUNCHER_IMAGE,
        "command": ["python3", "-u", "-c", inspect.getsource(custom_job_retry)],
        "args": [
            "--type", "CustomJob",
            "--payload", json.dumps(payload, sort_keys=True),
            "--project", PROJECT,
            "--location", LOCATION,
            "--gcp_resources", f"{{{{$.outputs.parameters['{GCP_RESOURCES}'].output_file}}}}",
        ],
    }  # fmt: skip


def as_custom_jobs(
    spec: dict[str, Any],
    machine_type: str,
    tpu_topology: str,
    labels: dict[str, str],
    timeout_h: float = 0.0,
) -> list[str]:
    """Rewrite every training executor of the compiled ``spec`` in place; returns their names.

    A training executor is one whose container sets ``ALIGNPIPE_ROLE=train``; ``timeout_h``
    bounds each job (0: the stage's ``STAGE_TIMEOUT_H``).
    """
    executors = spec["deploymentSpec"]["executors"]
    rewritten = []
    for label, executor in executors.items():
        container = executor.get("container", {})
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if env.get(ROLE_ENV) != "train":
            continue
        stage = label.removeprefix("exec-")
        pool = worker_pool(container, machine_type, tpu_topology)
        schedule = scheduling(stage, timeout_h)
        job = custom_job(f"alignpipe-{stage}", pool, {**labels, "stage": stage}, schedule)
        executor["container"] = launcher(job)
        rewritten.append(label)
    for component in spec["components"].values():
        if component.get("executorLabel") in rewritten:
            outputs = component.setdefault("outputDefinitions", {})
            outputs.setdefault("parameters", {})[GCP_RESOURCES] = {"parameterType": "STRING"}
    return rewritten


def payload_of(container: dict[str, Any]) -> dict[str, Any]:
    """The ``CustomJob`` a launcher container creates (placeholders left as they are)."""
    args = container["args"]
    return json.loads(args[args.index("--payload") + 1])
