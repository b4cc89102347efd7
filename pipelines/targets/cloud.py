"""Submit a compiled pipeline to a cloud target, or schedule it (Vertex AI or Kubeflow on GKE).

Vertex AI: ``aiplatform.PipelineJob`` (submit) and ``aiplatform.PipelineJobSchedule``
(schedule). Kubeflow on GKE: ``kfp.Client`` (``kfp_client``: host or kubeconfig context, IAP
or a bearer token; ``create_run_from_pipeline_package``, ``create_recurring_run``). The spec
comes from ``spec.py``. Settings are checked before any client is built, so a missing
project, region, host or pipeline root fails with a message that names the flag.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from pipelines import PIPELINE_NAME
from pipelines.targets.placement import Placement

# Vertex AI label keys and values: lowercase letters, digits, '_' and '-', at most 63.
_LABEL = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


class CloudError(ValueError):
    """Settings a cloud submission cannot start with; the message names the flag to set."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CloudSettings:
    """Where and as whom a pipeline runs in the cloud."""

    project: str = ""
    region: str = ""
    pipeline_root: str = ""
    service_account: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    host: str = ""  # Kubeflow Pipelines endpoint (gke target)
    # gke: the profile namespace of the run and its experiment (multi-user Kubeflow);
    # '' = the client's default namespace.
    namespace: str = ""
    kube_context: str = ""  # gke without --host: reach KFP through this kubeconfig context
    iap_client_id: str = ""  # gke behind Identity-Aware Proxy: its OAuth client id
    token_env: str = ""  # gke: the name of an environment variable holding a bearer token
    experiment: str = PIPELINE_NAME
    display_name: str = PIPELINE_NAME
    # None keeps each task's compiled setting (listings never cached, --fresh-from);
    # True or False would apply to every task alike.
    enable_caching: bool | None = None


def require(target: str, settings: CloudSettings, needed: tuple[str, ...], what: str) -> None:
    """Refuse ``settings`` without the ``needed`` fields, naming their flags; on gke a
    ``--kube-context`` stands for ``--host``. ``what`` says what needs them."""
    missing = [name for name in needed if not getattr(settings, name)]
    if target == "gke" and settings.kube_context and "host" in missing:
        missing.remove("host")  # the kubeconfig context names the cluster
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        hint = " (or --kube-context)" if "host" in missing else ""
        raise CloudError(f"{what} needs {flags}{hint}")


def require_token(settings: CloudSettings) -> None:
    """Refuse a ``--token-env`` naming an unset or empty environment variable."""
    if settings.token_env and not os.environ.get(settings.token_env):
        raise CloudError(
            f"--token-env {settings.token_env}: that environment variable is unset or empty; "
            "export the bearer token in it (the token itself is never a flag)"
        )


def check_settings(target: str, settings: CloudSettings) -> None:
    """Refuse settings a submission to ``target`` would fail on, naming the missing flag."""
    needed = {"vertex": ("project", "region", "pipeline_root"), "gke": ("host", "pipeline_root")}
    if target not in needed:
        raise CloudError(f"target: {target!r} cannot be submitted; use vertex or gke")
    require(target, settings, needed[target], f"the {target} target")
    require_token(settings)
    if not settings.pipeline_root.startswith("gs://"):
        raise CloudError(
            f"--pipeline-root {settings.pipeline_root!r} must be a gs:// folder: the stages "
            "read each other's artifacts from Cloud Storage"
        )
    for key, value in settings.labels.items():
        if not _LABEL.match(key) or not _LABEL_VALUE.match(value):
            raise CloudError(
                f"--label {key}={value}: keys and values take lowercase letters, digits, "
                "'_' and '-' (keys start with a letter), at most 63 characters"
            )


def settings_warnings(target: str, settings: CloudSettings) -> list[str]:
    """What a user should hear before a submission that would still start."""
    if target == "vertex" and not settings.service_account:
        return [
            "no --service-account: the run, and the TPU custom jobs it starts, use the "
            "project's Compute Engine default service account (usually the broad Editor "
            "role); pass a dedicated one with Vertex AI User and Storage access"
        ]
    return []


def kfp_client(s: CloudSettings) -> Any:
    """The Kubeflow Pipelines client of the gke target, authenticated as the flags say."""
    import kfp

    options: dict[str, Any] = {"host": s.host or None}
    if s.kube_context:
        options["kube_context"] = s.kube_context
    if s.iap_client_id:
        options["client_id"] = s.iap_client_id
    if s.token_env:
        options["existing_token"] = os.environ[s.token_env]
    return kfp.Client(**options)


def run_labels(placement: Placement, settings: CloudSettings) -> dict[str, str]:
    """The user's labels plus the placement (TPU, topology, machine type) and the code's
    version and commit (run_record.cloud_labels), for finding runs."""
    from pipelines import run_record

    placed = {key.replace("-", "_"): value for key, value in placement.describe().items()}
    return {"pipeline": PIPELINE_NAME, **placed, **run_record.cloud_labels(), **settings.labels}


def _vertex_job(package: str, values: dict[str, Any], labels: dict[str, str], s: CloudSettings):
    """The Vertex AI PipelineJob of one run of ``package``."""
    from google.cloud import aiplatform

    return aiplatform.PipelineJob(
        display_name=s.display_name,
        template_path=package,
        pipeline_root=s.pipeline_root,
        parameter_values=values,
        enable_caching=s.enable_caching,
        labels=labels,
        project=s.project,
        location=s.region,
    )


def submit(
    target: str, package: str, values: dict[str, Any], placement: Placement, s: CloudSettings
) -> Any:
    """Start one run of the compiled ``package``; returns the Vertex job or the KFP run."""
    check_settings(target, s)
    if target == "vertex":
        job = _vertex_job(package, values, run_labels(placement, s), s)
        job.submit(service_account=s.service_account or None)
        return job
    return kfp_client(s).create_run_from_pipeline_package(
        package,
        arguments=values,
        run_name=s.display_name,
        experiment_name=s.experiment,
        namespace=s.namespace or None,
        pipeline_root=s.pipeline_root,
        enable_caching=s.enable_caching,
        service_account=s.service_account or None,
    )


_NUMBER = re.compile("[0-9]+")  # ASCII digits: str.isdigit also takes "²" and "٣"
# The fields of a unix cron line: name, lowest and highest value, names allowed.
CRON_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                      "nov", "dec")),
    ("weekday", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)  # fmt: skip


def check_cron(cron: str, target: str = "vertex") -> None:
    """Refuse a cron line that Vertex or KFP would refuse only at scheduling time: 5 fields
    (UTC), each ``*``, a value, ``a-b``, any of them ``/step``, or a comma list of those.
    KFP (robfig/cron v1) takes weekdays 0-6 only; Vertex's unix-cron also 7 (Sunday)."""
    fields = cron.split()
    if len(fields) != len(CRON_FIELDS):
        raise CloudError(
            f"--cron {cron!r} must have 5 fields (minute hour day month weekday) in UTC, "
            "e.g. '0 3 * * 1' (Mondays 03:00 UTC); no TZ= prefix"
        )
    for text, (name, low, high, names) in zip(fields, CRON_FIELDS, strict=True):
        high = 6 if name == "weekday" and target == "gke" else high
        for item in text.split(","):
            span, slash, step = item.partition("/")
            bounds = [] if span == "*" else span.split("-")
            values = [_cron_value(v, low, names) for v in bounds]
            ok = len(bounds) <= 2 and all(v is not None and low <= v <= high for v in values)
            ok = ok and (not slash or (_NUMBER.fullmatch(step) is not None and int(step) > 0))
            ok = ok and values == sorted(values)
            if not ok:
                raise CloudError(
                    f"--cron {cron!r}: {text!r} is not a valid {name} ({low}-{high}, *, "
                    f"a-b, */n or a list of them)"
                )


def _cron_value(text: str, low: int, names: tuple[str, ...]) -> int | None:
    """A cron value as a number (``jan`` → 1, ``sun`` → 0); None when it is neither."""
    if _NUMBER.fullmatch(text):
        return int(text)
    if text.lower() in names:
        return names.index(text.lower()) + low
    return None


def schedule(
    target: str,
    package: str,
    values: dict[str, Any],
    placement: Placement,
    s: CloudSettings,
    cron: str,
) -> Any:
    """Run the compiled ``package`` on ``cron`` (5 fields, UTC), one run at a time."""
    check_settings(target, s)
    check_cron(cron, target)
    if target == "vertex":
        from google.cloud import aiplatform

        job = _vertex_job(package, values, run_labels(placement, s), s)
        scheduled = aiplatform.PipelineJobSchedule(
            pipeline_job=job, display_name=s.display_name, project=s.project, location=s.region
        )
        scheduled.create(
            cron=cron, max_concurrent_run_count=1, service_account=s.service_account or None
        )
        return scheduled
    client = kfp_client(s)
    experiment = client.create_experiment(name=s.experiment, namespace=s.namespace or None)
    return client.create_recurring_run(
        experiment_id=experiment.experiment_id,
        job_name=s.display_name,
        cron_expression="0 " + cron,  # KFP's cron has a leading seconds field
        max_concurrency=1,
        no_catchup=True,
        params=values,
        pipeline_package_path=package,
        pipeline_root=s.pipeline_root,
        enable_caching=s.enable_caching,
        service_account=s.service_account or None,
    )
