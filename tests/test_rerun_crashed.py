"""What ``make test`` runs again after a crashed test worker (tests/rerun_crashed.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rerun_crashed import to_rerun, why_not  # noqa: E402

CRASHED = "tests/test_a.py::test_crash"
UNRUN = ["tests/test_a.py::test_after", "tests/test_c.py::test_late"]


def test_the_crashed_tests_run_again_when_they_were_the_only_failures():
    assert to_rerun([CRASHED], {"failed": [CRASHED], "unrun": []}) == [CRASHED]
    other = {"failed": [CRASHED, "tests/test_b.py::test_real"], "unrun": []}
    assert to_rerun([CRASHED], other) == []
    assert to_rerun([], {"failed": ["tests/test_b.py::test_real"], "unrun": []}) == []
    assert to_rerun([CRASHED], None) == []  # no record of the run


def test_a_stalled_run_reruns_its_crashed_and_never_run_tests():
    record = {"failed": [CRASHED], "unrun": UNRUN}
    assert to_rerun([CRASHED, "STALLED"], record) == sorted([CRASHED, *UNRUN])
    other = {"failed": [CRASHED, "tests/test_b.py::test_real"], "unrun": UNRUN}
    assert to_rerun([CRASHED, "STALLED"], other) == []


def test_a_refusal_names_the_failures_that_stand():
    other = {"failed": [CRASHED, "tests/test_b.py::test_real"], "unrun": UNRUN}
    assert "tests/test_b.py::test_real" in why_not([CRASHED], other)
    assert "no test worker crashed" in why_not(["STALLED"], other)
    assert "left no record" in why_not([CRASHED], None)
