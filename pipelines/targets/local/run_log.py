"""A local run's log file: everything kfp.local and its tasks print, kept off the terminal.

kfp.local streams each task's whole output (executor inputs, Beam, Orbax's INFO lines per
checkpoint, TensorFlow warnings) to ``sys.stdout`` and logs its own events on the root
logger. While a run goes, :func:`capture` sends both, and ``sys.stderr``, to a file;
the terminal keeps only the progress lines run.py prints to the stream it held
before. :func:`task_errors` reads back what each failed task raised, since kfp.local's
own error names only the task and the conditions around it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

LOG_FILE = "run.log"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_START = re.compile(r"Executing task '([\w-]+)'")
_TASK_FAILED = re.compile(r"Task '([\w-]+)' finished with status FAILURE")
_TRACEBACK = "Traceback (most recent call last):"


class _PlainText(io.TextIOBase):
    """A text stream writing to ``file`` without terminal colour codes; ``on_line`` (if any)
    sees each whole line as it is written."""

    def __init__(self, file: io.TextIOBase, on_line: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._file, self._on_line, self._partial = file, on_line, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        plain = ANSI.sub("", text)
        self._file.write(plain)
        if self._on_line is not None:
            *lines, self._partial = (self._partial + plain).split("\n")
            for line in lines:
                self._on_line(line)
        return len(text)

    def flush(self) -> None:
        self._file.flush()


@contextlib.contextmanager
def capture(path: Path, on_line: Callable[[str], None] | None = None) -> Iterator[None]:
    """Send stdout, stderr and the root logger's records to the file ``path`` meanwhile;
    ``on_line`` sees each line printed (the tasks' progress lines among them)."""
    root = logging.getLogger()
    handlers = root.handlers[:]
    with open(path, "a", buffering=1, encoding="utf-8") as file:
        stream = _PlainText(file, on_line)
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.handlers[:] = [handler]
        try:
            with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
                yield
        finally:
            root.handlers[:] = handlers


def task_errors(text: str) -> dict[str, str]:
    """What each task that failed in the log ``text`` raised (its exception's last lines).

    A task's section runs from kfp.local's "Executing task" line to its "finished with
    status FAILURE" line; its error is the exception under the section's last traceback,
    or its last output line when it died without one (e.g. killed).
    """
    errors: dict[str, str] = {}
    section: list[str] = []
    for line in ANSI.sub("", text).splitlines():
        if _TASK_START.search(line):
            section = []
            continue
        failed = _TASK_FAILED.search(line)
        if failed:
            errors[failed.group(1)] = _exception(section)
            section = []
            continue
        section.append(line)
    return errors


def _exception(lines: list[str]) -> str:
    """The exception a task's output ends with, else its last line (or a note of none)."""
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK]
    if not starts:
        shown = [line.strip() for line in lines if line.strip()]
        if not shown:
            return "the task ended without output"
        return f"the task ended without a traceback; its last output: {shown[-1]}"
    indent = len(lines[starts[-1]]) - len(lines[starts[-1]].lstrip())
    message: list[str] = []
    for line in lines[starts[-1] + 1 :]:
        body = line[indent:]
        if not message and (not body.strip() or body[0].isspace()):
            continue  # still among the frames (indented: file, code, carets)
        if message and not line.strip():
            break  # kfp.local ends a task's output with an empty line
        message.append(body.rstrip())
    return "\n".join(message).strip() or "the task failed (no exception message in its log)"
