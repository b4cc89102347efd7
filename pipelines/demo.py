"""What ``make demo`` runs: ``alignpipe run`` with the embedded defaults, then its summary.

The built-in task's data is generated into the run folder (./runs/), the demo-preset
models are trained on 8 virtual CPU devices; the terminal shows a progress line per stage
and the summary, which names the run's log (``runs/<run>/run.log``: everything the tasks
printed). Extra arguments go to ``alignpipe run`` (e.g. ``--ppo-iterations 50``).
"""

from __future__ import annotations

import sys

from pipelines.cli.main import main


def demo(argv: list[str] | None = None) -> int:
    """Run the whole pipeline locally on the built-in task; returns the exit status."""
    return main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(demo())
