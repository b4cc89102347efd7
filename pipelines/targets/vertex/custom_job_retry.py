"""Run before GCPC's custom-job launcher: a retried Vertex training task starts a new job.

GCPC 2.22's launcher (``container/v1/custom_job/remote_runner.py``) first reads its
``gcp_resources`` output file; when that names a job it polls that job instead of creating
one (``JobRemoteRunner.check_if_job_exists``: meant for a launcher that was preempted while
its job ran), and ``poll_job`` raises at once on a FAILED, CANCELLED or PAUSED job. Where the
file is kept from one attempt of the task to the next, every retry would re-poll the failed
job and fail in seconds, and a preempted slice would never be retried. Neither Vertex's
retry documentation nor GCPC's code says whether a retried task gets a fresh file, so this
prelude makes both cases right: when the file names a job that ended without success (or
that no longer exists), it empties the file, which the launcher reads as "no job yet", and
the launcher creates a new one, which resumes from the stage's checkpoints. A job still
running or succeeded is left to the launcher, which then follows it as before.

It runs in GCPC's image (Python 3, ``google-cloud-aiplatform``), not in ours: the task's
command is ``python3 -u -c <this file's source>`` followed by the launcher's own arguments
(``vertex_jobs.launcher``), so it imports nothing from this project.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from collections.abc import Callable

GCPC_LAUNCHER = "google_cloud_pipeline_components.container.v1.custom_job.launcher"
# JobState names after which GCPC's poll_job raises (plus EXPIRED, which it would poll
# forever), and what the lookup reports for a job that is gone: a new job is due.
ENDED_WITHOUT_SUCCESS = (
    "JOB_STATE_FAILED",
    "JOB_STATE_CANCELLED",
    "JOB_STATE_PAUSED",
    "JOB_STATE_EXPIRED",
    "NOT_FOUND",
)


def flag(argv: list[str], name: str) -> str:
    """The value after ``name`` in the launcher's arguments ('' when absent)."""
    return argv[argv.index(name) + 1] if name in argv[:-1] else ""


def job_name(gcp_resources: str) -> str:
    """The job (``projects/P/locations/L/customJobs/ID``) a gcp_resources JSON names."""
    resources = json.loads(gcp_resources).get("resources") or []
    uri = resources[0].get("resourceUri", "") if resources else ""
    return uri.split("/v1/", 1)[1] if "/v1/" in uri else ""


def job_state(name: str, location: str) -> str:
    """The job's JobState name, as Vertex reports it now; NOT_FOUND when it is gone."""
    from google.api_core import exceptions
    from google.cloud import aiplatform_v1

    endpoint = location + "-aiplatform.googleapis.com"
    client = aiplatform_v1.JobServiceClient(client_options={"api_endpoint": endpoint})
    try:
        return client.get_custom_job(name=name).state.name
    except exceptions.NotFound:
        return "NOT_FOUND"


def forget_ended_job(path: str, state_of: Callable[[str], str]) -> str:
    """Empty ``path`` (the gcp_resources file) when the job it names ended without success;
    returns that job's state ('' when the file names no job)."""
    if not path or not os.path.exists(path) or os.path.getsize(path) == 0:
        return ""
    with open(path) as handle:
        name = job_name(handle.read())
    if not name:
        return ""
    try:
        state = state_of(name)
    except Exception as error:  # the launcher will report what fails; this only helps it
        print(f"could not read the state of {name} ({error}); the launcher follows it", flush=True)
        return ""
    if state in ENDED_WITHOUT_SUCCESS:
        print(f"{name} ended {state}: this attempt starts a new custom job", flush=True)
        open(path, "w").close()
    else:
        print(f"{name} is {state}: the launcher follows it", flush=True)
    return state


def main(argv: list[str]) -> None:
    """Clear a failed job from gcp_resources, then run GCPC's launcher with ``argv``."""
    location = flag(argv, "--location")
    forget_ended_job(flag(argv, "--gcp_resources"), lambda name: job_state(name, location))
    sys.argv = [GCPC_LAUNCHER, *argv]
    runpy.run_module(GCPC_LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
