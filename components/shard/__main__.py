"""Container entry point of the shard stage: flags → ShardConfig → run.

Unrecognised arguments are Beam pipeline options and pass through unchanged
(e.g. ``--runner DataflowRunner --project P --region R --temp_location gs://…``).
"""

from __future__ import annotations

import argparse
import json
import sys

from components.core.entry import USER_ERRORS, configure_logging
from components.core.flags import add_config_flags, config_from_flags
from components.shard.config import ShardConfig


def parser(prog: str = "python -m components.shard") -> argparse.ArgumentParser:
    """The stage's flags: inputs, output, and one flag per ShardConfig field."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Validate, deduplicate, tokenize and shard preference pairs (Apache Beam). "
        "Any other --option is passed to Beam unchanged.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="preference files (JSONL, JSON, Parquet, CSV, Arrow), globs, Hugging Face "
        "dataset folders or bq://PROJECT.DATASET.TABLE",
    )
    p.add_argument(
        "--heldout-input",
        nargs="+",
        default=[],
        help="preference data from other annotators (as --input), all of it put in the "
        "'heldout' split, on which the reward stage trains the held-out reward model and "
        "nothing else trains",
    )
    p.add_argument("--output", required=True, help="output folder (local or gs://)")
    add_config_flags(p, ShardConfig)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m components.shard") -> int:
    from components.core.data.tokenizers import TokenizerError
    from components.shard.sources import InputError
    from components.shard.stage import ShardError, run

    args, beam_args = parser(prog).parse_known_args(argv)
    configure_logging()
    try:
        config = config_from_flags(ShardConfig, args)
        manifest = run(
            config, args.input, args.output, beam_args, heldout_inputs=args.heldout_input
        )
    except (ShardError, InputError, TokenizerError, *USER_ERRORS) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"output": args.output, **manifest["counts"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
