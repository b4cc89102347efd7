"""``alignpipe runs [show RUN]`` and ``alignpipe config dump``: the local runs' records, and
a configuration file of every parameter.

``runs`` lists the run folders under ``--runs-dir`` that hold a ``run.json``
(pipelines/run_record.py): when each started, how long it took, its outcome and the
parameters set other than by default. ``runs show RUN`` prints one record: the code and
library versions, every parameter with its source, the inputs' digests and each stage.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipelines.cli import options


def add_runs(parser: argparse.ArgumentParser) -> None:
    """``alignpipe runs [list|show RUN]``."""
    parser.add_argument("action", nargs="?", default="list", choices=("list", "show"))
    parser.add_argument("run", nargs="?", default=None, help="show: a run folder's name or path")
    parser.add_argument("--runs-dir", default="runs", help="pipeline root of local runs (runs)")
    parser.add_argument("--json", action="store_true", help="show: the record as JSON")
    parser.set_defaults(handler=lambda args, rest: options.guard(lambda: _runs(args)))


def add_config(parser: argparse.ArgumentParser) -> None:
    """``alignpipe config dump [-o FILE] [flags]``."""
    parser.add_argument("action", choices=("dump",), help="dump: write the configuration")
    parser.add_argument("-o", "--output", default="-", help="file to write (- = stdout)")
    options.add_param_flags(parser, note="written instead of its default")
    parser.set_defaults(handler=lambda args, rest: options.guard(lambda: _config(args)))


def _config(args: argparse.Namespace) -> int:
    from components.core import fileio
    from pipelines.dag import config_file

    values, _ = options.given(args)
    text = config_file.dump(values)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        fileio.write_text(args.output, text)
        print(f"wrote {args.output}: `alignpipe run --config {args.output}` runs it")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from pipelines.targets.local.run import read_record, run_folders

    if args.action == "show":
        if not args.run:
            raise ValueError("runs show: name the run (a folder `alignpipe runs` lists)")
        record = read_record(args.runs_dir, args.run)
        print(json.dumps(record, indent=2, sort_keys=True) if args.json else describe(record))
        return 0
    folders = run_folders(args.runs_dir)
    if not folders:
        print(f"no runs with a record under {args.runs_dir}")
        return 0
    for folder in folders:
        record = read_record(args.runs_dir, str(folder))
        print(f"{folder.name}  {summary(record)}")
    return 0


def summary(record: dict) -> str:
    """One line: start, seconds, outcome, the parameters set other than by default."""
    chosen = [
        f"{name}={entry['value']}"
        for name, entry in sorted(record["parameters"].items())
        if entry["source"] not in ("default", None) and name != "promoted_policy_uri"
    ]
    return f"{record['started']}  {record['seconds']:7.1f} s  {record['outcome']:9s}  " + " ".join(
        chosen
    )


def describe(record: dict) -> str:
    """The record, for reading."""
    code = record["code"]
    commit = code.get("commit") or "not a git checkout"
    if code.get("dirty"):
        commit += " (with uncommitted changes)"
    lines = [
        f"started {record['started']}, ended {record['ended']} ({record['seconds']} s): "
        f"{record['outcome']}" + (f": {record['error']}" if record.get("error") else ""),
        f"alignpipe {code['alignpipe']}, commit {commit}",
        "libraries: " + ", ".join(f"{k} {v}" for k, v in record["libraries"].items() if v),
        "stages: "
        + ", ".join(
            f"{name} {entry['status']}" + (f" {entry['seconds']:.1f} s" if entry["seconds"] else "")
            for name, entry in record["stages"].items()
        ),
        "inputs:",
    ]
    for name, paths in record["inputs"].items():
        lines += [f"  {name}: {path} {digest}" for path, digest in paths.items()]
    lines.append("parameters (value, where it came from):")
    for name, entry in sorted(record["parameters"].items()):
        lines.append(f"  {name} = {entry['value']!r}  ({entry['source']})")
    return "\n".join(lines)
