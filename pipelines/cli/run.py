"""``alignpipe run`` and ``alignpipe rerun``: the whole pipeline locally (kfp.local, cached)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipelines.cli import options
from pipelines.dag.stages import STAGES


def add_run(parser: argparse.ArgumentParser) -> None:
    """``alignpipe run``: every pipeline parameter a flag."""
    options.add_local_options(parser)
    options.add_param_flags(parser)
    parser.set_defaults(handler=_run)


def add_rerun(parser: argparse.ArgumentParser) -> None:
    """``alignpipe rerun --from STAGE [--run RUN]``: a run again (the last one unless --run
    names one), recomputing from STAGE on."""
    parser.add_argument(
        "--from", dest="from_stage", required=True, choices=STAGES,
        help="this stage and every stage after it run again; earlier ones come from the cache",
    )  # fmt: skip
    parser.add_argument(
        "--run", default=None, metavar="RUN",
        help="the run to repeat: a run folder's name (alignpipe runs) or path; default the last",
    )  # fmt: skip
    options.add_local_options(parser)
    options.add_param_flags(parser, note="changes the last run's value")
    parser.set_defaults(handler=_rerun)


def _local(
    sourced: tuple[dict[str, Any], dict[str, str]],
    args: argparse.Namespace,
    fresh_from: str | None,
) -> int:
    """Run locally with (values, their sources), print the summary; 1 if the pipeline failed."""
    from pipelines.targets.local.result import format_summary
    from pipelines.targets.local.run import run_local

    values, sources = sourced
    if args.verbose:  # the tasks inherit it (components/core/entry.py)
        from components.core.entry import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    result = run_local(
        values, runs_dir=args.runs_dir, fresh_from=fresh_from, cpu_devices=args.cpu_devices,
        sources=sources,
    )  # fmt: skip
    print("\n" + format_summary(result))
    return 1 if result.error else 0


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe run."""
    return options.guard(lambda: _local(options.sourced_values(args), args, None))


def _rerun(args: argparse.Namespace, rest: list[str]) -> int:
    """alignpipe rerun --from STAGE: a run's values, caching off from STAGE on."""
    return options.guard(lambda: _local(_rerun_values(args), args, args.from_stage))


def _rerun_values(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The repeated run's values (its run.json, or the last run's), the flags over them."""
    from pipelines.dag.tasks import with_task
    from pipelines.targets.local.run import last_values, run_values

    before = run_values(args.runs_dir, args.run) if args.run else last_values(args.runs_dir)
    values, sources = options.given(args)
    # The recorded run's values already hold its task's settings; a task's defaults come
    # in only when the flags name one (they would otherwise override what was recorded).
    if "task" in values:
        values, sources = with_task(values, sources)
    return {**before, **values}, {name: "last run" for name in before} | sources
