"""After a failed ``make test``: when every failure was a test whose xdist worker crashed
under it (a segfault inside XLA:CPU's compiler, about once a run on 2 cores in
2026-12-05's runs, never the same test twice), run those tests again in one fresh process
and exit with their status; otherwise exit 1 (the run's failures stand).

A crashed test is a failure of the process, not of the test: its rerun asserts everything
the test asserts. Any other failure, or a run the watchdog ended (tests/conftest.py), is
left as it failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRASHED = ROOT / ".pytest_cache" / "alignpipe-crashed"
LAST_FAILED = ROOT / ".pytest_cache" / "v" / "cache" / "lastfailed"


def main() -> int:
    crashed = CRASHED.read_text().split() if CRASHED.exists() else []
    failed = set(json.loads(LAST_FAILED.read_text())) if LAST_FAILED.exists() else set()
    if not crashed or "STALLED" in crashed or not failed or not failed <= set(crashed):
        return 1
    print(f"\nrerun_crashed: every failure was a crashed worker's test; running again: {crashed}")
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *sorted(set(crashed))], cwd=ROOT)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
