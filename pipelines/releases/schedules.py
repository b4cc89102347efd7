"""Schedules as users manage them: list, pause, resume, delete (Vertex AI and Kubeflow on GKE).

Vertex AI: ``aiplatform.PipelineJobSchedule`` (``list``, ``get``, then ``pause``,
``resume(catch_up=False)``, ``delete``); a schedule is named by its resource name or its
ID within ``--project``/``--region``. Kubeflow on GKE: ``kfp.Client`` recurring runs
(``list_recurring_runs``, ``disable_recurring_run``, ``enable_recurring_run``,
``delete_recurring_run``). Resuming never catches up on the runs a pause skipped, as
``alignpipe schedule`` creates them (``no_catchup``): a realignment run reads the newest
data anyway.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pipelines.targets.cloud import CloudError, CloudSettings, require, require_token

ACTIONS = ("pause", "resume", "delete")
_KFP_PAGE = 100


class ScheduleRow(NamedTuple):
    """One schedule as ``alignpipe schedule list`` shows it."""

    schedule_id: str
    display_name: str
    cron: str
    state: str  # active or paused
    next_run: str  # Vertex's next run time, else ''


def check_settings(target: str, s: CloudSettings) -> None:
    """Where the schedules are: project and region (vertex) or the KFP host (gke)."""
    needed = {"vertex": ("project", "region"), "gke": ("host",)}
    if target not in needed:
        raise CloudError(f"target: {target!r} has no schedules; use vertex or gke")
    require(target, s, needed[target], f"managing schedules on {target}")
    require_token(s)


def list_schedules(target: str, s: CloudSettings) -> list[ScheduleRow]:
    """Every schedule of the project and region (vertex) or the KFP host (gke), newest first."""
    check_settings(target, s)
    if target == "vertex":
        from google.cloud import aiplatform

        found = aiplatform.PipelineJobSchedule.list(
            order_by="create_time desc", project=s.project, location=s.region
        )
        return [_vertex_row(schedule.gca_resource) for schedule in found]
    runs = _kfp_recurring_runs(_kfp_client(s), s.namespace or None)
    return [_kfp_row(run) for run in runs]


def change(target: str, s: CloudSettings, schedule_id: str, action: str) -> None:
    """Pause, resume or delete one schedule."""
    check_settings(target, s)
    if action not in ACTIONS:
        raise CloudError(f"schedule action: {action!r} is unknown; use one of {ACTIONS}")
    if not schedule_id:
        raise CloudError(f"schedule {action} needs a SCHEDULE id: see `alignpipe schedule list`")
    if target == "vertex":
        from google.cloud import aiplatform

        schedule = aiplatform.PipelineJobSchedule.get(
            schedule_id, project=s.project, location=s.region
        )
        if action == "resume":
            schedule.resume(catch_up=False)
        else:
            getattr(schedule, action)()
        return
    client = _kfp_client(s)
    calls = {
        "pause": client.disable_recurring_run,
        "resume": client.enable_recurring_run,
        "delete": client.delete_recurring_run,
    }
    calls[action](recurring_run_id=schedule_id)


def format_schedules(rows: list[ScheduleRow]) -> str:
    """The rows as an aligned table."""
    header = ScheduleRow("schedule", "name", "cron", "state", "next run (UTC)")
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join(line.rstrip() for line in lines)


def _vertex_row(resource: Any) -> ScheduleRow:
    """A row from an ``aiplatform_v1.types.Schedule``."""
    state = resource.state.name.lower() if resource.state else "unspecified"
    next_run = resource.next_run_time
    shown = next_run.isoformat()[:16].replace("T", " ") if next_run else ""
    return ScheduleRow(
        resource.name.rsplit("/", 1)[-1], resource.display_name, resource.cron, state, shown
    )


def _kfp_row(run: Any) -> ScheduleRow:
    """A row from a ``kfp_server_api`` ``V2beta1RecurringRun``."""
    trigger = run.trigger
    cron = trigger.cron_schedule.cron if trigger and trigger.cron_schedule else ""
    cron = " ".join(cron.split()[1:]) if len(cron.split()) == 6 else cron  # drop the seconds
    status = str(run.status or "").lower()
    state = {"enabled": "active", "disabled": "paused"}.get(status, status or "unspecified")
    return ScheduleRow(run.recurring_run_id, run.display_name or "", cron, state, "")


def _kfp_client(s: CloudSettings) -> Any:
    from pipelines.targets.cloud import kfp_client

    return kfp_client(s)  # the host or kubeconfig context and auth options submit uses


def _kfp_recurring_runs(client: Any, namespace: str | None) -> list[Any]:
    """Every recurring run (of the profile ``namespace``, when given), page by page."""
    runs, token = [], ""
    while True:
        page = client.list_recurring_runs(
            page_token=token, page_size=_KFP_PAGE, sort_by="created_at desc", namespace=namespace
        )
        runs += page.recurring_runs or []
        token = page.next_page_token or ""
        if not token:
            return runs
