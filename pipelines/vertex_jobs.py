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
"""

from __future__ import annotations

import json
from typing import Any

# The launcher image of GCPC 2.22.0 (google_cloud_pipeline_components/_image.py). It only
# creates and polls the job: the stage's code runs in the training image.
LAUNCHER_IMAGE = "gcr.io/ml-pipeline/google-cloud-pipeline-components:2.22.0"
LAUNCHER_MODULE = "google_cloud_pipeline_components.container.v1.custom_job.launcher"
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


def custom_job(name: str, pool: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The ``CustomJob`` payload of the launcher (fields as aiplatform_v1.types.CustomJob)."""
    return {
        "display_name": name,
        "job_spec": {"worker_pool_specs": [pool], "service_account": SERVICE_ACCOUNT},
        "labels": labels,
    }


def launcher(payload: dict[str, Any]) -> dict[str, Any]:
    """The executor container that creates the custom job and waits for it."""
    return {
        "image": LAUNCHER_IMAGE,
        "command": ["python3", "-u", "-m", LAUNCHER_MODULE],
        "args": [
            "--type", "CustomJob",
            "--payload", json.dumps(payload, sort_keys=True),
            "--project", PROJECT,
            "--location", LOCATION,
            "--gcp_resources", f"{{{{$.outputs.parameters['{GCP_RESOURCES}'].output_file}}}}",
        ],
    }  # fmt: skip


def as_custom_jobs(
    spec: dict[str, Any], machine_type: str, tpu_topology: str, labels: dict[str, str]
) -> list[str]:
    """Rewrite every training executor of the compiled ``spec`` in place; returns their names.

    A training executor is one whose container sets ``ALIGNPIPE_ROLE=train``.
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
        job = custom_job(f"alignpipe-{stage}", pool, {**labels, "stage": stage})
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
