"""What every stage's ``__main__`` shares: logging set-up and user-facing errors."""

from __future__ import annotations

import atexit
import functools
import gc
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

# Errors a user can fix from the message alone; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FloatingPointError,
    # A file where a folder goes (--output one.jsonl) or the reverse, or no right to write.
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
    PermissionError,
)


CPU_DEVICES_ENV = "ALIGNPIPE_CPU_DEVICES"
DEFAULT_CPU_DEVICES = 8


def configure_cpu_devices() -> None:
    """Give the CPU backend virtual devices (default 8) so pmap runs data-parallel on CPU.

    Only the CPU backend is affected: on TPU or GPU, the accelerators are the devices.
    Must run before the first JAX computation.
    """
    import jax

    jax.config.update("jax_num_cpu_devices", cpu_device_count())


def cpu_device_count() -> int:
    """``$ALIGNPIPE_CPU_DEVICES`` (default 8), refused unless a whole number of at least 1."""
    raw = os.environ.get(CPU_DEVICES_ENV, str(DEFAULT_CPU_DEVICES))
    # ASCII digits: str.isdigit also takes "²", which int() then refuses with its own message.
    count = int(raw) if re.fullmatch("[0-9]+", raw.strip()) else 0
    if count < 1:
        raise ValueError(
            f"{CPU_DEVICES_ENV}={raw!r}: the virtual CPU devices per process must be a whole "
            f"number of at least 1 (unset: {DEFAULT_CPU_DEVICES})"
        )
    return count


class _DropImportNoise(logging.Filter):
    """Drops Beam's import-time warning about optional GCP clients we do not use."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


def configure_logging(level: int = logging.INFO) -> None:
    """Root logging to stderr at ``level``, without known import-time noise."""
    # force: importing orbax configures the root logger first, which would hide INFO lines.
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropImportNoise())
    quiet_libraries(level)


VERBOSE_ENV = "ALIGNPIPE_VERBOSE"  # set (alignpipe run --verbose): the libraries' INFO lines too
# Orbax logs every checkpoint step at INFO through absl (775 of the demo's 1,664 log lines),
# and JAX each backend it probes (TPU on a CPU machine).
NOISY_LOGGERS = ("absl", "jax._src.xla_bridge")


def quiet_libraries(level: int = logging.INFO) -> None:
    """Keep only the warnings of the libraries in NOISY_LOGGERS, unless VERBOSE_ENV is set."""
    if os.environ.get(VERBOSE_ENV):
        return
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def settle_heap() -> None:
    """Keep Python's cyclic garbage collector off the objects alive now, here and at exit.

    A stage process holds some 370,000 long-lived objects from its imports (JAX, Orbax,
    TensorFlow). The interpreter's collections at exit walked them all: 1.1-2.2 s between
    a tiny-model stage's last line and its end on 2 cores (0.2-0.55 s frozen), and every
    full collection while it runs walks them again. ``gc.freeze`` moves them to the
    permanent generation, which no collection scans; call this after the heavy imports (the
    entries and :func:`~components.core.data.tensorflow_import.import_tensorflow` do). One
    collection first, so no garbage of the imports is frozen with them; objects alive are
    unaffected, and garbage made later is collected as before. At exit, before the
    interpreter's last collections, what is alive is frozen again: a stage has flushed and
    closed what it writes before it returns, and the process frees its memory anyway.
    """
    gc.collect()
    gc.freeze()
    _freeze_at_exit()


@functools.cache
def _freeze_at_exit() -> None:
    atexit.register(gc.freeze)


def start_process() -> None:
    """A stage process's start, before JAX computes: quiet TensorFlow, virtual CPU devices,
    the imports' objects out of garbage collections (the CLI entries and the kfp tasks)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    configure_cpu_devices()
    quiet_libraries()
    settle_heap()


def run_stage(body: Callable[[], dict[str, Any]]) -> int:
    """Run a stage body; print its summary as JSON, or a one-line error and return 1."""
    try:
        start_process()
        configure_logging()
        summary = body()
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary, default=float, sort_keys=True))
    return 0


# Path arguments whose flag is not their name without ``_dir``: one spelling per concept
# across the commands (the pipeline's eval_reward_model, evaluate's --reward-model).
PATH_FLAGS = {"reward_dir": "--reward-model"}


def path_flag(name: str) -> str:
    """The flag of a stage's path argument ``name``."""
    return PATH_FLAGS.get(name) or "--" + name.removesuffix("_dir").replace("_", "-")


def stage_main(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    config_cls: type,
    paths: dict[str, str],
    run: Callable[..., dict[str, Any]],
    optional: tuple[str, ...] = (),
) -> int:
    """A stage's container entry: ``--<path>`` flags and one flag per config field → ``run``.
    The paths named in ``optional`` may be left out ('' then).

    ``paths`` maps each path argument of ``run`` (e.g. ``shards_dir``) to its help text;
    its flag is the name without a ``_dir`` suffix (``--shards``), except those spelled as
    every command spells them (PATH_FLAGS: a reward model folder is ``--reward-model``).
    """
    import argparse

    from components.core.flags import add_config_flags, add_renamed, config_from_flags

    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, help_text in paths.items():
        flag = path_flag(name)
        parser.add_argument(
            flag, dest=name, required=name not in optional, default="", help=help_text
        )
        if name in PATH_FLAGS:
            add_renamed(parser, "--" + name.removesuffix("_dir").replace("_", "-"), flag)
    add_config_flags(parser, config_cls)
    args = parser.parse_args(argv)
    return run_stage(
        lambda: run(config_from_flags(config_cls, args), **{n: getattr(args, n) for n in paths})
    )
