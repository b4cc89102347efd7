"""A test worker that crashes mid-run under ``make test``'s xdist settings: the run still
runs every test and ends (tests/conftest.py's scheduler), instead of waiting for ever."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

QUIET = """
import time

import pytest


@pytest.mark.parametrize("i", range(4))
def test_quiet(i):
    time.sleep(0.05)
"""

# Crashes its worker once (a flag file marks it), as XLA:CPU's compiler did.
CRASHING = """
import os
import signal
from pathlib import Path

import pytest

FLAG = Path(__file__).with_name("crashed")


@pytest.mark.parametrize("i", range(4))
def test_crash_once(i):
    if i == 1 and not FLAG.exists():
        FLAG.touch()
        os.kill(os.getpid(), signal.SIGSEGV)
"""


def test_a_worker_that_crashes_in_its_second_module_does_not_stall_the_run(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("conftest.py", "rerun_crashed.py"):
        shutil.copy(HERE / name, tests / name)
    (tests / "module_durations.json").write_text("{}")
    for letter in "abcdef":  # each worker finishes modules before the last one crashes it
        (tests / f"test_{letter}.py").write_text(QUIET)
    (tests / "test_z.py").write_text(CRASHING)
    env = {**os.environ, "ALIGNPIPE_STALL_SECONDS": "60"}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
               "--no-loadscope-reorder", "tests"]  # fmt: skip
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    out = run.stdout + run.stderr
    assert (tests / "crashed").exists(), out
    assert "conftest: a test worker crashed" not in out, out  # not ended by the watchdog
    # 28 tests: the crashed one failed, then ran again with the rest of its module, passing.
    assert "1 failed, 28 passed" in out, out
    rerun = subprocess.run([sys.executable, "tests/rerun_crashed.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=240)  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "1 passed" in rerun.stdout, rerun.stdout
