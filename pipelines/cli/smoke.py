"""``alignpipe smoke``: one tiny task on the requested TPU before a real run.

It takes the placement and cloud flags of ``alignpipe submit`` (the same helpers build
them), compiles the smoke pipeline (``pipelines/targets/smoke.py``) and submits it, or only writes
it with ``--compile-only -o FILE``. The task's log lists the devices JAX sees; its output
is a JSON summary (platform, devices, hosts, the pmap step's time). First it prints the
grants each account of the run needs (``pipelines/targets/iam.py``), which the run then exercises.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipelines.cli import pipeline as cli_pipeline
from pipelines.targets.smoke import SMOKE_PIPELINE


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``smoke`` to the top-level parser."""
    smoke = commands.add_parser(
        "smoke",
        help="one tiny task on the requested TPU: the devices JAX sees and one pmap step "
        "(checks project, quota, image and permissions in minutes)",
        description="Compile and submit a one-task pipeline on the training image, placed like "
        "the training tasks (vertex: a TPU custom job; gke: the TPU node pool, or a JobSet over "
        "the hosts of a multi-host slice), that prints the devices JAX sees, fails unless they "
        "are the requested TPU chips, and runs one jax.pmap step. Never cached; no retries "
        "unless --train-retries.",
    )
    cli_pipeline._placement_options(smoke)
    cli_pipeline._cloud_options(smoke)
    smoke.add_argument("--compile-only", action="store_true", help="only write the spec to -o FILE")
    smoke.add_argument("-o", "--output", default="", help="also keep the compiled spec here")
    smoke.add_argument(
        "--wait", action="store_true",
        help="wait for the run to end; exit 1 unless it succeeded",
    )  # fmt: skip
    # A failed smoke run should say so at once, not after three preemption retries.
    smoke.set_defaults(handler=_smoke, display_name=SMOKE_PIPELINE, train_retries=0)


def _smoke(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe smoke."""
    return cli_pipeline._guard(lambda: _compile_or_submit(args))


def _compile_or_submit(args: argparse.Namespace) -> int:
    """Compile the smoke pipeline; unless --compile-only, submit it (and --wait for it)."""
    from pipelines.targets import cloud
    from pipelines.targets.smoke import compile_smoke

    if args.compile_only and not args.output:
        raise ValueError("--compile-only needs -o FILE: the smoke pipeline spec to write")
    placement = cli_pipeline._placement(args)
    slice_ = ", ".join(f"{k} {v}" for k, v in placement.describe().items() if k != "target")
    settings = cli_pipeline._settings(args)
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
    return _wait(args.target, run) if args.wait else 0


def _print_checklist(target: str, settings: Any, placement: Any) -> None:
    """The grants the run needs (docs/cloud-iam.md), which the smoke run then tries."""
    from pipelines.targets import iam

    print(f"accounts and grants a {target} run needs (docs/cloud-iam.md):")
    for line in iam.checklist(target, settings, placement):
        print(f"  - {line}")


def _wait(target: str, run: Any) -> int:
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
