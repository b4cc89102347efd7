"""``alignpipe submit --wait``: follow a submitted run to its end, one line per task change.

The console URL comes first, at once; then every poll prints each task whose state changed
(Vertex's ``PipelineTaskDetail`` states, KFP's run details), and the run's end: exit 0 when
it succeeded, else 1 with each failed task's own error. Polling reads the services' own
records (``PipelineJob.state`` and ``task_details``; ``kfp.Client.get_run``), so a wait
that is interrupted loses nothing: the run goes on, and its page has everything.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

SUCCEEDED = "SUCCEEDED"
ENDED = {"SUCCEEDED", "FAILED", "CANCELLED", "CANCELED", "SKIPPED"}
POLL_SECONDS = 30


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A run's state and each task's (state, error message)."""

    state: str
    tasks: dict[str, tuple[str, str]]


def vertex_snapshot(job: Any) -> Snapshot:
    """A Vertex ``PipelineJob``'s state and its tasks' (``state`` syncs the job)."""
    state = job.state.name.removeprefix("PIPELINE_STATE_")
    tasks = {
        detail.task_name: (detail.state.name, detail.error.message)
        for detail in job.task_details
        if detail.task_name
    }
    return Snapshot(state, tasks)


def vertex_url(job: Any) -> str:
    """The run's page in the Cloud console."""
    fields = job._parse_resource_name(job.resource_name)  # the SDK's own parser
    return (
        f"https://console.cloud.google.com/vertex-ai/locations/{fields['location']}/pipelines/"
        f"runs/{fields['pipeline_job']}?project={fields['project']}"
    )


def kfp_snapshot(client: Any, run_id: str) -> Snapshot:
    """A Kubeflow Pipelines run's state and its tasks' (``kfp.Client.get_run``)."""
    run = client.get_run(run_id)
    details = run.run_details.task_details if run.run_details else None
    tasks = {
        task.display_name: (str(task.state or "PENDING"), task.error.message if task.error else "")
        for task in details or ()
        if task.display_name
    }
    return Snapshot(str(run.state or "PENDING"), tasks)


def follow(
    snapshot: Callable[[], Snapshot],
    url: str,
    *,
    interval: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Print ``url``, then each task's state as it changes until the run ends; 0 when it
    succeeded, else 1 with the failed tasks' errors on stderr."""
    print(f"run page: {url}", flush=True)
    seen: dict[str, str] = {}
    while True:
        current = snapshot()
        for task, (state, _) in current.tasks.items():  # in the order the service lists them
            if seen.get(task) != state:
                print(f"  {task}: {state.lower()}", flush=True)
                seen[task] = state
        if current.state in ENDED:
            break
        sleep(interval)
    if current.state == SUCCEEDED:
        print("run succeeded")
        return 0
    failed = [(t, error) for t, (state, error) in current.tasks.items() if state == "FAILED"]
    print(f"run {current.state.lower()}", file=sys.stderr)
    for task, error in failed:
        print(f"  {task} failed: {error or 'no message; see its log on the run page'}",
              file=sys.stderr)  # fmt: skip
    return 1
