"""The ``alignpipe`` command line: every command registered in one table, listed by group.

A command is a function that adds its flags to its parser and sets its handler, in the
module of its group (``cli/run.py``, ``cli/cloud.py``, ``cli/data.py``, ``cli/model.py``,
``cli/releases.py``; ``cli/run_presets.py`` for ``run-presets``). The flags several commands share
live in ``cli/options.py``; no command module imports another.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
from collections.abc import Callable

# Quiet TensorFlow's C++ start-up chatter before anything imports it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GROUPS = {
    "run": "the pipeline on this machine",
    "cloud": "the pipeline on Vertex AI or Kubeflow on GKE",
    "data": "preference data",
    "model": "models in and out, evaluation",
    "releases": "promoted policy versions",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """One ``alignpipe`` command: its group, name, one-line help and the function that adds
    its flags and handler to its parser."""

    group: str
    name: str
    help: str
    add: Callable[[argparse.ArgumentParser], None]
    add_help: bool = True  # False: the command passes its flags on (data shard, evaluate)


def commands() -> tuple[Command, ...]:
    """Every command, in the order ``alignpipe --help`` lists them."""
    from pipelines.cli import cloud, completion, data, model, plan, releases, run, run_presets, runs

    return (
        Command("run", "run", "run the whole pipeline locally (kfp.local, cached)", run.add_run),
        Command(
            "run",
            "rerun",
            "repeat the last local run, recomputing from one stage on",
            run.add_rerun,
        ),  # fmt: skip
        Command(
            "run",
            "runs",
            "the local runs and their records (run.json): list, or show one",
            runs.add_runs,
        ),  # fmt: skip
        Command(
            "run",
            "config",
            "config dump: a YAML file of every pipeline parameter (run, compile, submit, "
            "schedule and plan read it with --config)",
            runs.add_config,
        ),  # fmt: skip
        Command(
            "run",
            "completion",
            'shell completion: eval "$(alignpipe completion bash)" (or zsh)',
            completion.add_completion,
        ),  # fmt: skip
        Command("cloud", "compile", "write the pipeline spec for vertex or gke", cloud.add_compile),
        Command("cloud", "submit", "compile and start one run on vertex or gke", cloud.add_submit),
        Command(
            "cloud",
            "schedule",
            "compile and run on a cron schedule (periodic realignment); list, pause, resume "
            "or delete schedules",
            cloud.add_schedule,
        ),  # fmt: skip
        Command(
            "cloud",
            "smoke",
            "one tiny task on the requested TPU: the devices JAX sees and one pmap step "
            "(checks project, quota, image and permissions in minutes)",
            cloud.add_smoke,
        ),  # fmt: skip
        Command(
            "cloud",
            "run-presets",
            "run presets (model class on a TPU slice): memory per chip and the flags",
            run_presets.add_run_presets,
        ),  # fmt: skip
        Command(
            "cloud",
            "plan",
            "each stage's memory per chip, phase by phase, with the flags over a run preset "
            "(--compile: beside XLA's figures of the compiled programs)",
            plan.add_plan,
        ),  # fmt: skip
        Command(
            "cloud",
            "rbac",
            "gke: print the Role and RoleBinding a run's service account needs to run "
            "multi-host TPU tasks as JobSets (kubectl apply -f -)",
            cloud.add_rbac,
        ),  # fmt: skip
        Command("data", "data", "generate, validate and shard preference data", data.add_data),
        Command(
            "model",
            "model",
            "import Hugging Face checkpoints as model artifacts, export policies back",
            model.add_model,
        ),  # fmt: skip
        Command(
            "model",
            "evaluate",
            "evaluate an aligned policy against its reference and write the report (see --help)",
            model.add_evaluate,
            add_help=False,
        ),  # fmt: skip
        Command(
            "model",
            "generate",
            "print a policy's answer to a prompt: its chat template, its stop tokens "
            "(--compare: another policy's beside it)",
            model.add_generate,
        ),  # fmt: skip
        Command(
            "model",
            "chat",
            "talk to a policy turn after turn (its chat template, its stop tokens; /reset, /exit)",
            model.add_chat,
        ),  # fmt: skip
        Command(
            "model",
            "report",
            "print the path of a local run's report.html (newest first)",
            model.add_report,
        ),  # fmt: skip
        Command(
            "releases",
            "history",
            "the versions promoted to a promoted_policy_uri, and its rollbacks",
            releases.add_history,
        ),  # fmt: skip
        Command(
            "releases",
            "rollback",
            "make an earlier promoted version current again (recorded in the history)",
            releases.add_rollback,
        ),  # fmt: skip
        Command(
            "releases",
            "promote",
            "add a policy folder to a promoted_policy_uri as a new version (e.g. seed it "
            "with the original SFT or base policy: the anchor of later runs)",
            releases.add_promote,
        ),  # fmt: skip
    )


def command_listing(table: tuple[Command, ...]) -> str:
    """The commands by group, for ``alignpipe --help``."""
    width = max(len(command.name) for command in table) + 2
    lines = ["commands:"]
    for group, about in GROUPS.items():
        lines.append(f"  {group} ({about}):")
        for command in (c for c in table if c.group == group):
            lines += textwrap.wrap(
                command.help, 92, initial_indent=f"    {command.name:<{width}}",
                subsequent_indent=" " * (4 + width),
            )  # fmt: skip
    return "\n".join(lines)


def _version() -> str:
    """The installed distribution's version, with the git commit of a source checkout."""
    import subprocess
    from importlib import metadata
    from pathlib import Path

    version = metadata.version("alignpipe")
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version} ({commit})" if commit else version


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command of the table registered."""
    table = commands()
    parser = argparse.ArgumentParser(
        prog="alignpipe",
        description="RLHF alignment pipeline: shard preference data, train a reward model,\n"
        "align a policy with PPO, evaluate — locally or on Vertex AI / GKE.",
        epilog=command_listing(table) + "\n\n`alignpipe COMMAND --help` describes one.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The listing is the epilog's, by group; argparse's own would be one flat list.
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS
    )
    parser.add_argument("--version", action="version", version=f"alignpipe {_version()}")
    # Set after the subparsers take their prog ("alignpipe"), or theirs would repeat it.
    parser.usage = "alignpipe [-h] COMMAND ..."
    for command in table:
        command.add(subparsers.add_parser(command.name, add_help=command.add_help))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``alignpipe`` console script."""
    import logging

    from components.core.entry import configure_logging

    argv = sys.argv[1:] if argv is None else argv
    configure_logging(logging.WARNING)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "accepts_extra", False):
        hint = ""
        if any(not arg.startswith("-") for arg in rest):  # a glob the shell expanded
            hint = "; quote globs so the shell leaves them alone: --data-uri 'data/*.jsonl'"
        parser.error(f"unrecognized arguments: {' '.join(rest)}{hint}")
    args.root_parser = parser  # what `completion` reads the commands from
    return int(args.handler(args, rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
