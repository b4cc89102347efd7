"""The ``alignpipe`` command line: one sub-command group per concern.

- ``alignpipe data generate|shard|validate``: preference data (cli/data.py)
- ``alignpipe evaluate|report``: evaluation (cli/evaluate.py)
- ``alignpipe run|rerun|compile|submit|schedule``: the pipeline (cli/pipeline.py)
- ``alignpipe model import|export``: Hugging Face checkpoints (cli/model.py)
- ``alignpipe presets [NAME]``: run presets and their memory arithmetic (cli/presets.py)
- ``alignpipe history|rollback``: promoted policy versions (cli/releases.py)
- ``alignpipe smoke``: one tiny task on the requested TPU before a real run (cli/smoke.py)
"""

from __future__ import annotations

import argparse
import os
import sys

# Quiet TensorFlow's C++ start-up chatter before anything imports it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command registered."""
    from pipelines.cli import data, evaluate, model, pipeline, presets, releases, smoke

    parser = argparse.ArgumentParser(
        prog="alignpipe",
        description="RLHF alignment pipeline: shard preference data, train a reward model, "
        "align a policy with PPO, evaluate — locally or on Vertex AI / GKE.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    data.register(commands)
    evaluate.register(commands)
    pipeline.register(commands)
    model.register(commands)
    presets.register(commands)
    releases.register(commands)
    smoke.register(commands)
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
    return int(args.handler(args, rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
