"""``alignpipe evaluate …`` runs the evaluate stage; ``alignpipe report`` finds its report."""

from __future__ import annotations

import argparse
import os
import sys
import webbrowser

REPORT_FILE = "report.html"


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``evaluate`` and ``report`` commands to the top-level parser."""
    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate an aligned policy against its reference and write the report (see --help)",
        add_help=False,
    )
    # The stage's own entry point parses the flags, so the two never drift apart.
    evaluate.set_defaults(handler=_evaluate, accepts_extra=True)

    report = commands.add_parser(
        "report", help="print the path of a local run's report.html (newest first)"
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a local run or pipeline-root folder")
    report.add_argument("--open", action="store_true", help="open the newest report in a browser")
    report.set_defaults(handler=_report)


def _evaluate(args: argparse.Namespace, rest: list[str]) -> int:
    from components.evaluate.__main__ import main

    return main(rest, prog="alignpipe evaluate")


def find_reports(run_dir: str) -> list[str]:
    """Every report.html under ``run_dir``, newest first (a link to a file that is gone is
    no report)."""
    found = [
        os.path.join(folder, REPORT_FILE)
        for folder, _, files in os.walk(run_dir)
        if REPORT_FILE in files and os.path.isfile(os.path.join(folder, REPORT_FILE))
    ]
    return sorted(found, key=lambda path: (os.path.getmtime(path), path), reverse=True)


def _report(args: argparse.Namespace, rest: list[str]) -> int:
    if not os.path.isdir(args.run_dir):
        print(f"error: {args.run_dir} is not a folder; pass a local run folder", file=sys.stderr)
        return 1
    reports = find_reports(args.run_dir)
    if not reports:
        print(
            f"error: no {REPORT_FILE} under {args.run_dir}; the evaluate step has not run "
            "there yet (run the pipeline or `alignpipe evaluate … --output DIR`)",
            file=sys.stderr,
        )
        return 1
    for path in reports:
        print(os.path.abspath(path))
    if args.open:
        webbrowser.open("file://" + os.path.abspath(reports[0]))
    return 0
