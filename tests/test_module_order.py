"""``make test`` and ``make test-all`` each start their longest modules first: a module's
slow-tier time counts only in a run that selects its slow tests (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

MIXED = """
import pytest


def test_quick():
    pass


@pytest.mark.slow
def test_long():
    pass
"""
PLAIN = """
def test_medium():
    pass
"""


def _order(tmp_path: Path, *flags: str) -> list[str]:
    """The modules in the order the run would start them (``--collect-only``)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               *flags, "tests"]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    modules = [line.split("::")[0] for line in run.stdout.splitlines() if "::" in line]
    return list(dict.fromkeys(modules))


def test_a_modules_slow_tests_weigh_only_in_the_runs_that_select_them(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(HERE / "conftest.py", tests / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: the slow tier\n")
    (tests / "test_mixed.py").write_text(MIXED)
    (tests / "test_plain.py").write_text(PLAIN)
    durations = {"test_mixed.py": 1.0, "test_mixed.py [slow]": 100.0, "test_plain.py": 10.0}
    (tests / "module_durations.json").write_text(json.dumps(durations))
    assert _order(tmp_path) == ["tests/test_mixed.py", "tests/test_plain.py"]
    assert _order(tmp_path, "-m", "not slow") == ["tests/test_plain.py", "tests/test_mixed.py"]
