"""After a failed ``make test``: when every failure was a test whose xdist worker crashed
under it (a segfault inside XLA:CPU's compiler, about once a run on 2 cores in
2026-12-05's runs, never the same test twice), run those tests again in one fresh process
and exit with their status; otherwise exit 1 (the run's failures stand).

A crashed test is a failure of the process, not of the test: its rerun asserts everything
the test asserts. Any other failure is left as it failed. A run the watchdog ended
(tests/conftest.py: xdist stopped scheduling after the crash) reruns its crashed tests and
every test it never ran, when the crashed tests were its only failures. The run's failures
and never-run tests come from the record xdist's controller writes (conftest.RUN_RECORD),
not pytest's ``lastfailed`` cache, which keeps failures of earlier runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRASHED = ROOT / ".pytest_cache" / "alignpipe-crashed"
RUN_RECORD = CRASHED.with_name("alignpipe-run.json")


def to_rerun(crashed: list[str], record: dict | None) -> list[str]:
    """The tests to run again: the crashed ones and those the run never ran, when the
    crashed tests were its only failures; [] when some other failure stands."""
    tests = set(crashed) - {"STALLED"}
    if not tests or record is None or set(record["failed"]) - tests:
        return []
    return sorted(tests | set(record["unrun"]))


def why_not(crashed: list[str], record: dict | None) -> str:
    """Why a failed run's tests are not run again, for the log."""
    if not set(crashed) - {"STALLED"}:
        return "no test worker crashed; the run's failures stand"
    if record is None:
        return f"the run left no record ({RUN_RECORD.name}); the run's failures stand"
    other = sorted(set(record["failed"]) - set(crashed))
    return f"{len(other)} failures besides the crashed tests stand: {other[:10]}"


def main() -> int:
    crashed = CRASHED.read_text().split() if CRASHED.exists() else []
    record = json.loads(RUN_RECORD.read_text()) if RUN_RECORD.exists() else None
    tests = to_rerun(crashed, record)
    if not tests:
        print(f"\nrerun_crashed: nothing to run again: {why_not(crashed, record)}")
        return 1
    print(f"\nrerun_crashed: every failure was a crashed worker's test; running again "
          f"{len(tests)} tests: {tests[:10]}{' ...' if len(tests) > 10 else ''}")  # fmt: skip
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *tests], cwd=ROOT)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
