"""The cloud commands: ``compile``, ``submit`` and ``schedule`` the pipeline on vertex or gke,
``smoke`` (one tiny task on the requested TPU before a real run), and ``rbac`` (what a gke
run's service account needs for multi-host slices).

``smoke`` compiles the smoke pipeline (``pipelines/targets/smoke.py``) and submits it, or
only writes it with ``--compile-only -o FILE``. The task's log lists the devices JAX sees;
its output is a JSON summary (platform, devices, hosts, the pmap step's time). First it
prints the grants each account of the run needs (``pipelines/targets/iam.py``), which the
run then exercises.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipelines.cli import options
from pipelines.dag import params
from pipelines.targets.smoke import SMOKE_PIPELINE

SCHEDULE_ACTIONS = ("pause", "resume", "delete")  # what schedules.change does


def add_compile(parser: argparse.ArgumentParser) -> None:
    """``alignpipe compile -o FILE``: the pipeline spec for vertex or gke."""
    parser.add_argument("-o", "--output", required=True, help="pipeline spec file to write")
    options.add_placement_options(parser)
    options.add_dag_options(parser)
    options.add_param_flags(parser, note="becomes the compiled default")
    parser.set_defaults(handler=_compile)


def add_submit(parser: argparse.ArgumentParser) -> None:
    """``alignpipe submit``: compile and start one run."""
    parser.add_argument(
        "--wait", action="store_true",
        help="follow the run: its console page at once, each task's state as it changes; "
        "exit 1 with the failed task's error unless it succeeded",
    )  # fmt: skip
    options.add_placement_options(parser)
    options.add_dag_options(parser)
    options.add_cloud_options(parser)
    options.add_param_flags(parser)
    parser.set_defaults(handler=_submit)


def add_schedule(parser: argparse.ArgumentParser) -> None:
    """``alignpipe schedule [create|list|pause|resume|delete]``: runs on a cron schedule."""
    parser.description = (
        "create (the default): compile and schedule the pipeline on --cron. "
        "list: the schedules of --project/--region (vertex) or --host (gke). pause, resume, "
        "delete SCHEDULE: one of them, by the id list shows (resume skips the missed runs)."
    )
    parser.add_argument(
        "action", nargs="?", default="create", choices=("create", "list", *SCHEDULE_ACTIONS),
        help="create (default), list, pause, resume or delete",
    )  # fmt: skip
    parser.add_argument(
        "schedule_id", nargs="?", default="", metavar="SCHEDULE",
        help="pause, resume, delete: the schedule's id (Vertex: its ID or resource name)",
    )  # fmt: skip
    parser.add_argument(
        "--cron", default="", help='create: 5-field cron in UTC, e.g. "0 3 * * 1" (Mondays 03:00)'
    )
    options.add_placement_options(parser)
    options.add_dag_options(parser)
    options.add_cloud_options(parser)
    options.add_param_flags(parser)
    parser.set_defaults(handler=_schedule)


def add_smoke(parser: argparse.ArgumentParser) -> None:
    """``alignpipe smoke``: one task placed like the training tasks, nothing else of the DAG."""
    parser.description = (
        "Compile and submit a one-task pipeline on the training image, placed like "
        "the training tasks (vertex: a TPU custom job; gke: the TPU node pool, or a JobSet over "
        "the hosts of a multi-host slice), that prints the devices JAX sees, fails unless they "
        "are the requested TPU chips, and runs one jax.pmap step. Never cached; no retries "
        "unless --train-retries."
    )
    options.add_placement_options(parser)
    options.add_cloud_options(parser)
    parser.add_argument(
        "--compile-only", action="store_true", help="only write the spec to -o FILE"
    )
    parser.add_argument("-o", "--output", default="", help="also keep the compiled spec here")
    parser.add_argument(
        "--wait", action="store_true",
        help="wait for the run to end; exit 1 unless it succeeded",
    )  # fmt: skip
    # A failed smoke run should say so at once, not after three preemption retries.
    parser.set_defaults(handler=_smoke, display_name=SMOKE_PIPELINE, train_retries=0)


def add_rbac(parser: argparse.ArgumentParser) -> None:
    """``alignpipe rbac``: the Role and RoleBinding of the JobSet launcher (gke)."""
    parser.add_argument("--namespace", required=True, help="the namespace the runs' pods run in")
    parser.add_argument(
        "--service-account", required=True,
        help="the Kubernetes service account of the runs' pods (submit's --service-account; "
        "multi-user Kubeflow: default-editor, standalone KFP: pipeline-runner)",
    )  # fmt: skip
    parser.set_defaults(handler=_rbac)


def _compile(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe compile."""
    from pipelines.targets.spec import compile_pipeline

    def body() -> int:
        placement = options.placement(args)
        values, sources = options.sourced_values(args)
        compile_pipeline(placement, values, args.output, args.fresh_from, sources)
        print(f"wrote {args.output} ({args.target}: {placement.describe()})")
        return 0

    return options.guard(body)


def _cloud(args: argparse.Namespace, action: str) -> int:
    """Check settings, compile to a temporary file, then submit or schedule it."""
    from pipelines.targets import cloud
    from pipelines.targets.function_files import with_uploaded_functions
    from pipelines.targets.spec import compile_pipeline

    placement, settings = options.placement(args), options.settings(args)
    values, sources = options.sourced_values(args)
    cloud.check_settings(args.target, settings)  # before compiling: fail fast on settings
    # Training state outside the artifacts, where a retried task finds it.
    values = params.with_cloud_checkpoint_root(values, settings.pipeline_root)
    # A local reward or gold function file travels with the run (function_files.py).
    values = with_uploaded_functions(values, settings.pipeline_root)
    if "checkpoint_root" not in sources and values.get("checkpoint_root"):
        sources = {**sources, "checkpoint_root": "pipeline root"}  # the run record says so
    for warning in cloud.settings_warnings(args.target, settings):
        print(f"warning: {warning}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as folder:
        package = str(Path(folder) / "alignpipe.yaml")
        compile_pipeline(placement, values, package, args.fresh_from, sources)
        if action == "submit":
            run = cloud.submit(args.target, package, values, placement, settings)
            what = f"submitted to {args.target}"
            if args.wait:
                print(f"{what}: {getattr(run, 'resource_name', run)}")
                return _follow(args.target, run, settings)
        else:
            run = cloud.schedule(args.target, package, values, placement, settings, args.cron)
            what = f"scheduled on {args.target} at '{args.cron}'"
        print(f"{what}: {getattr(run, 'resource_name', run)}")
    return 0


def _follow(target: str, run: Any, settings: Any) -> int:
    """submit --wait: follow the run to its end (pipelines/targets/watch.py)."""
    from pipelines.targets import cloud, watch

    if target == "vertex":
        return watch.follow(lambda: watch.vertex_snapshot(run), watch.vertex_url(run))
    client = cloud.kfp_client(settings)
    url = f"{settings.host.rstrip('/')}/#/runs/details/{run.run_id}"
    return watch.follow(lambda: watch.kfp_snapshot(client, run.run_id), url)


def _submit(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe submit."""
    return options.guard(lambda: _cloud(args, "submit"))


def _schedule(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe schedule [create|list|pause|resume|delete]."""
    if args.action == "create":
        return options.guard(lambda: _create_schedule(args))
    return options.guard(lambda: _manage_schedules(args))


def _create_schedule(args: argparse.Namespace) -> int:
    """Check what only create reads (its cron, no SCHEDULE), then compile and schedule."""
    from pipelines.targets import cloud

    if not args.cron:
        raise ValueError("schedule create needs --cron, e.g. --cron '0 3 * * 1'")
    if args.schedule_id:
        raise ValueError(
            f"schedule create takes no SCHEDULE ({args.schedule_id!r}); did you mean "
            f"`schedule pause|resume|delete {args.schedule_id}`?"
        )
    cloud.check_cron(args.cron, args.target)  # before compiling
    return _cloud(args, "schedule")


def _manage_schedules(args: argparse.Namespace) -> int:
    """List the target's schedules, or pause, resume or delete one."""
    from pipelines.dag.preflight import flag
    from pipelines.releases import schedules

    given = [name for name in vars(args) if name.startswith("param_")]
    if args.action == "list" and args.schedule_id:
        raise ValueError(f"schedule list takes no SCHEDULE ({args.schedule_id!r})")
    if args.cron or given:
        ignored = "--cron" if args.cron else flag(given[0][len("param_") :])
        raise ValueError(f"schedule {args.action} takes no {ignored}; only create reads it")
    settings = options.settings(args)
    if args.action == "list":
        rows = schedules.list_schedules(args.target, settings)
        print(schedules.format_schedules(rows) if rows else f"no schedules on {args.target}")
        return 0
    schedules.change(args.target, settings, args.schedule_id, args.action)
    done = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[args.action]
    print(f"schedule {args.schedule_id} {done} on {args.target}")
    return 0


def _rbac(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe rbac: the launcher's Role and RoleBinding as YAML."""
    import yaml

    from pipelines.targets.gke import jobset

    print(yaml.safe_dump_all(jobset.rbac(args.namespace, args.service_account), sort_keys=False))
    return 0


def _smoke(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe smoke."""
    return options.guard(lambda: _compile_or_submit_smoke(args))


def _compile_or_submit_smoke(args: argparse.Namespace) -> int:
    """Compile the smoke pipeline; unless --compile-only, submit it (and --wait for it)."""
    from pipelines.targets import cloud
    from pipelines.targets.spec import compile_smoke

    if args.compile_only and not args.output:
        raise ValueError("--compile-only needs -o FILE: the smoke pipeline spec to write")
    placement = options.placement(args)
    slice_ = ", ".join(f"{k} {v}" for k, v in placement.describe().items() if k != "target")
    settings = options.settings(args)
    _print_checklist(args.target, settings, placement)
    if args.compile_only:
        compile_smoke(placement, args.output)
        print(f"wrote {args.output} (smoke on {args.target}: {slice_})")
        return 0
    # The run's labels say it was a smoke run (a --label pipeline=... still wins).
    settings = dataclasses.replace(settings, labels={"pipeline": SMOKE_PIPELINE, **settings.labels})
    cloud.check_settings(args.target, settings)  # before compiling: fail fast on settings
    for warning in cloud.settings_warnings(args.target, settings):
        print(f"warning: {warning}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as folder:
        package = args.output or str(Path(folder) / f"{SMOKE_PIPELINE}.yaml")
        compile_smoke(placement, package)
        run = cloud.submit(args.target, package, {}, placement, settings)
    name = getattr(run, "resource_name", None) or getattr(run, "run_id", run)
    print(f"submitted the smoke run to {args.target} ({slice_}): {name}")
    print("its task log lists the devices JAX sees; its output is a JSON summary")
    return _wait_for_smoke(args.target, run) if args.wait else 0


def _print_checklist(target: str, settings: Any, placement: Any) -> None:
    """The grants the run needs (docs/cloud-iam.md), which the smoke run then tries."""
    from pipelines.targets import iam

    print(f"accounts and grants a {target} run needs (docs/cloud-iam.md):")
    for line in iam.checklist(target, settings, placement):
        print(f"  - {line}")


def _wait_for_smoke(target: str, run: Any) -> int:
    """Block until the run ends; 0 when it succeeded, else 1 with the reason."""
    if target == "vertex":
        try:
            run.wait()  # raises when the job failed or was cancelled
        except RuntimeError as error:
            print(f"smoke run failed: {error}", file=sys.stderr)
            return 1
        print("smoke run succeeded")
        return 0
    state = str(run.wait_for_run_completion().state or "").upper()
    if state != "SUCCEEDED":
        print(f"smoke run ended {state or 'without a state'}: see its task log", file=sys.stderr)
        return 1
    print("smoke run succeeded")
    return 0
