"""Test set-up: 8 virtual CPU devices for pmap, before any JAX computation.

One persistent XLA compilation cache per test session, for the stage processes tests start
(they inherit the environment): the same stage compiled again in another process or run
(kfp.local tasks, resumed runs) is read back instead of recompiled. Cached executables are
XLA's own output for the same program, so results do not change; only the compile time
goes. Every program is cached, however quick its compile: a stage process runs dozens of
small ones (each initialiser, each eager op), about 2.5 s of compiling in all on 2 cores,
read back in about 0.5 s.

pytest-xdist's workers themselves do not use it: XLA:CPU's executable serialization, which
each cache write runs, aborted a worker (``Fatal Python error: Aborted`` in
``put_executable_and_time``, 2026-12-05) about once a suite run, after a few thousand
compiles in that process; the worker died, and the CI run with it. A worker's own programs
are compiled once per module anyway.

Each module's compiled programs are freed at its end (``pytest_runtest_teardown``): XLA:CPU
maps every executable it loads into its own memory areas, and a worker that kept them all
ran into Linux's limit of 65,530 areas a process (``vm.max_map_count``). Measured
2026-12-06: four modules in one process held 23,164 areas (test_ppo_update.py alone 17,359),
924 after ``jax.clear_caches()``. Past the limit ``mmap`` fails inside XLA's compiler, and
the worker died of a segfault in ``backend_compile_and_load`` (or the abort above) about
once a ``make test``, in a different test each time, never in a test run alone.
"""

import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# LLVM at -O1 instead of XLA's -O3: the tests compile far more than they run. No fast-math
# flags are set, so LLVM may not reorder float arithmetic, and the bits are the same
# (measured: the PPO update's state after 4 calls hashes alike, and `make demo` at -O1 prints
# every figure to the last digit; at -O0 the hash differed, so not -O0). test_ppo_update and
# test_fsdp took 0.78-0.86x the CPU time, two rounds each way, and the multi-process modules
# 0.80x. Stages outside the tests keep -O3: the demo gains nothing (205 vs 208 s), its time
# is running, not compiling.
# One LLVM module per program (no parallel codegen): XLA:CPU split codegen ran in threads
# beside two workers on 2 cores for nothing, and two workers crashed inside XLA:CPU's
# compile or its executable serialization (2026-12-05, docstring); serial codegen takes the
# threads out of it. The same IR: the golden tests' bits hold.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
# Made by the first process of the session (pytest-xdist's controller, or a plain pytest),
# which removes it at the end; workers inherit the variable. A folder the user named is kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="alignpipe-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Weight-file digests (components/core/file_digest.py) are cached in the session's folder,
# not the user's ~/.cache.
if _OWN_CACHE is not None:
    os.environ.setdefault("ALIGNPIPE_DIGEST_CACHE", os.path.join(_OWN_CACHE, "digests.json"))


def _cheap_kfp_caller_name() -> None:
    """kfp 2.17's task setters (``set_cpu_limit``, ``set_env_variable``, ...) each call
    ``inspect.stack()``, which reads the source of every frame on the stack, for one error
    message's caller name. Under pytest (deep stacks, ~6,900 modules, which
    ``inspect.getmodule`` scans for each frame it cannot place) that was most of a pipeline
    compile: 28 of 47 s profiled over nine of test_vertex_jobs.py's tests. The same check
    and message, the caller's name read from its frame. Applied only while kfp's method is
    the one this replaces."""
    import inspect as _inspect

    from kfp.dsl import pipeline_task

    original = pipeline_task.PipelineTask._ensure_container_spec_exists
    if "inspect.stack()[1][3]" not in _inspect.getsource(original):
        return

    def _ensure_container_spec_exists(self) -> None:
        if self.container_spec is None:
            caller_method_name = sys._getframe(1).f_code.co_name
            raise ValueError(
                f"{caller_method_name} can only be used on single-step components, not "
                "pipelines used as components, or special components like importers."
            )

    pipeline_task.PipelineTask._ensure_container_spec_exists = _ensure_container_spec_exists


_cheap_kfp_caller_name()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_compilation_cache", False)  # this process only (docstring)


import pytest  # noqa: E402


@pytest.fixture
def sharded_placements(monkeypatch):
    """Counts the trees placed in chunks (fsdp): proves a run really sharded its state."""
    from components.core.training import fsdp

    calls = []
    shard = fsdp.shard

    def counting(tree, *args, **kwargs):
        calls.append(fsdp.is_sharded(placed := shard(tree, *args, **kwargs)))
        return placed

    monkeypatch.setattr(fsdp, "shard", counting)
    return calls


# Modules run longest first: with pytest-xdist (``-n 2 --dist loadfile --no-loadscope-reorder``,
# as ``make test`` runs) each worker starts on a long one and the short ones fill in after,
# instead of two long ones ending the run on one worker. How long each module takes is
# measured, not kept by hand: every run records its modules' times in pytest's cache, and
# ``make test-durations`` copies the last whole run's into DURATIONS (read when a fresh clone
# has no cache).
DURATIONS = Path(__file__).with_name("module_durations.json")
CACHE_KEY = "alignpipe/module_durations"
SLOW = " [slow]"  # a module's slow-tier tests are timed apart: `make test` leaves them out
_measured: dict[str, float] = {}


def module_durations(config) -> dict[str, float]:
    """Seconds each test module took, by file name: the cache's over DURATIONS' (a partial
    run's cache alone put the modules it never ran last, the longest among them)."""
    cache = getattr(config, "cache", None)
    recorded = cache.get(CACHE_KEY, None) if cache is not None else None
    kept = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    return {**kept, **(recorded or {})}


def pytest_runtest_logreport(report):
    """Add each test's setup, call and teardown time to its module's (on xdist's controller
    the workers' reports arrive here too)."""
    name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    name += SLOW if "slow" in report.keywords else ""
    _measured[name] = _measured.get(name, 0.0) + report.duration
    _reported.add(report.nodeid)
    if report.failed:
        _failed.add(report.nodeid)
    global _last_report
    _last_report = _monotonic()


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``: xdist's own scheduler, less the stall after a worker crash."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RequeueUnfinished(LoadFileScheduling):
        """pytest-xdist 3.8 queues again every module a crashed worker was given, the ones
        it had finished too. A worker later handed a finished module is sent no test, so no
        report comes back to hand it the next one: the run waited for ever with modules
        queued and both workers idle (2026-12-05 and -06, CI and here; reproduced with a
        worker that crashes in its second module). Only unfinished modules go back."""

        def remove_node(self, node):
            workload = self.assigned_work.get(node, {})
            for scope in [scope for scope, tests in workload.items() if all(tests.values())]:
                del workload[scope]
            return super().remove_node(node)

    return RequeueUnfinished(config, log)


# After a worker crash, pytest-xdist (3.x, --dist loadfile) replaces it and goes on, but then
# waited for ever at the end with both workers idle (py-spy: the controller in
# DSession.loop_once, 2026-12-05): CI's limit, not pytest, ended the run. The cause is mended
# above; should a run stall after a crash all the same, a watchdog on the controller ends it
# once no test has reported for STALL_SECONDS, naming why; the longest test takes under 7
# minutes.
STALL_SECONDS = int(os.environ.get("ALIGNPIPE_STALL_SECONDS", "900"))
_monotonic = time.monotonic  # tests monkeypatch time.monotonic; the watchdog keeps its own
_last_report = _monotonic()
# The controller's view of the run, for a stalled run's rerun (tests/rerun_crashed.py): every
# collected test, those that reported, and those that failed.
_collected: set[str] = set()
_reported: set[str] = set()
_failed: set[str] = set()
# The tests whose worker crashed under them (one node id a line; STALLED when the run was
# ended by the watchdog): tests/rerun_crashed.py runs them again, alone, when they are the
# run's only failures. Written as each crash happens, by xdist's controller.
CRASHED = Path(__file__).resolve().parent.parent / ".pytest_cache" / "alignpipe-crashed"
STALLED = "STALLED"
# The run's failures and the tests it never ran (JSON), written by xdist's controller at the
# end, or by the watchdog when it ends a stalled run.
RUN_RECORD = CRASHED.with_name("alignpipe-run.json")


def _write_run_record() -> None:
    crashed = set(CRASHED.read_text(encoding="utf-8").split()) if CRASHED.exists() else set()
    unrun = sorted(_collected - _reported - crashed)
    RUN_RECORD.parent.mkdir(parents=True, exist_ok=True)
    RUN_RECORD.write_text(json.dumps({"failed": sorted(_failed), "unrun": unrun}))


def pytest_sessionstart(session):
    """The controller (or a plain pytest) starts with no crash recorded."""
    if not hasattr(session.config, "workerinput"):
        CRASHED.unlink(missing_ok=True)
        RUN_RECORD.unlink(missing_ok=True)


def pytest_xdist_node_collection_finished(node, ids):
    """xdist's controller: what the workers collected (the same on each)."""
    _collected.update(ids)


_scheduler = []  # xdist's scheduler, kept at a crash for the watchdog's message


def _scheduler_state() -> str:
    """What xdist's (loadfile) scheduler still holds: why the run stalled, for the log."""
    if not _scheduler:
        return ""
    sched = _scheduler[0]
    pending = {
        node.gateway.id: sum(not done for unit in work.values() for done in unit.values())
        for node, work in getattr(sched, "assigned_work", {}).items()
    }
    queued = list(getattr(sched, "workqueue", {}))
    return f"; xdist: modules queued {queued}, tests pending by worker {pending}"


def pytest_handlecrashitem(crashitem, report, sched):
    """xdist's controller: the test a crashed worker was running."""
    _scheduler[:] = [sched]
    CRASHED.parent.mkdir(parents=True, exist_ok=True)
    with CRASHED.open("a", encoding="utf-8") as handle:
        handle.write(crashitem + "\n")


def pytest_testnodedown(node, error):
    """xdist's controller: a worker went down; if it crashed, watch for the stall."""
    if not error:
        return

    def watch() -> None:
        while _monotonic() - _last_report < STALL_SECONDS:
            time.sleep(10)
        with CRASHED.open("a", encoding="utf-8") as handle:
            handle.write(STALLED + "\n")
        _write_run_record()
        sys.stderr.write(
            f"\nconftest: a test worker crashed ({error}) and no test has reported for "
            f"{STALL_SECONDS} s since: pytest-xdist stopped scheduling; ending the run "
            f"(failed){_scheduler_state()}\n"
        )
        sys.stderr.flush()
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="xdist-stall-watchdog").start()


def pytest_sessionfinish(session):
    """Record this run's module times over the earlier ones (a partial run updates its own)."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller records
    if _collected:  # xdist's controller: for tests/rerun_crashed.py
        _write_run_record()
    cache = getattr(session.config, "cache", None)
    if cache is None or not _measured:
        return
    recorded = {**(cache.get(CACHE_KEY, None) or {}), **_measured}
    cache.set(CACHE_KEY, {name: round(seconds, 1) for name, seconds in sorted(recorded.items())})


def pytest_unconfigure(config):
    """The session's compilation cache goes with it (tens of MB a run, left in /tmp before)."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test and its fixtures' teardown, free the programs it compiled
    (the memory-area limit, docstring); the next module compiles its own."""
    result = yield
    if nextitem is None or nextitem.path != item.path:
        jax.clear_caches()
        gc.collect()
    return result


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    """Modules longest first (by their recorded times, a module's slow tests counted only when
    they run); tests in a module keep their order."""
    durations = module_durations(config)
    slow = {item.path.name for item in items if item.get_closest_marker("slow")}

    def seconds(name: str) -> float:
        return durations.get(name, 0.0) + (durations.get(name + SLOW, 0.0) if name in slow else 0)

    items.sort(key=lambda item: -seconds(item.path.name))
