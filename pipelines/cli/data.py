"""``alignpipe data …``: generate the built-in task, shard files, validate files."""

from __future__ import annotations

import argparse
import math
import sys

from components.core.flags import add_config_flags, config_from_flags
from components.shard.config import ShardConfig


def add_data(parser: argparse.ArgumentParser) -> None:
    """``alignpipe data generate|shard|validate``."""
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    generate = sub.add_parser(
        "generate", help="write the built-in task's preference pairs as JSONL"
    )
    generate.add_argument("--out", required=True, help="output JSONL path (local or gs://)")
    generate.add_argument("--pairs", type=int, default=2000, help="number of pairs (default 2000)")
    generate.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    generate.add_argument(
        "--beta", type=float, default=10.0, help="label sharpness of the Bradley-Terry draw"
    )
    generate.add_argument(
        "--conversational",
        action="store_true",
        help="write each pair as chat messages (prompt: [system,] user; chosen/rejected: "
        "assistant), which the shard stage renders with the model's chat template",
    )
    generate.add_argument(
        "--system",
        default="",
        help="with --conversational: a system message before each prompt (default none; "
        "some templates, e.g. Gemma 2's, refuse a system role)",
    )
    generate.set_defaults(handler=_generate)

    shard = sub.add_parser(
        "shard",
        help="validate, dedupe, tokenize and shard files (Beam; see --help)",
        add_help=False,
    )
    shard.set_defaults(handler=_shard, accepts_extra=True)

    validate = sub.add_parser(
        "validate",
        help="report rejected records per reason and the eval split; exit 1 when the shard "
        "stage would refuse them",
    )
    validate.add_argument(
        "files",
        nargs="+",
        help="preference files (JSONL, JSON, Parquet, CSV, Arrow), globs or dataset folders",
    )
    add_config_flags(validate, ShardConfig, skip=("num_shards", "num_workers"))
    validate.set_defaults(handler=_validate)


def _generate(args: argparse.Namespace, rest: list[str]) -> int:
    from components.core.data.builtin_task import GOLD_REWARD_NAME, write_jsonl

    if args.pairs < 1:
        print("error: --pairs must be at least 1", file=sys.stderr)
        return 2
    if not 0 < args.beta < math.inf:  # nan too
        # beta < 0 labels the worse response chosen, 0 (or nan) labels at random.
        print(f"error: --beta must be a finite number > 0, got {args.beta}", file=sys.stderr)
        return 2
    if args.system and not args.conversational:
        print("error: --system applies to --conversational pairs only", file=sys.stderr)
        return 2
    try:
        count = write_jsonl(
            args.out, args.pairs, seed=args.seed, beta=args.beta,
            conversational=args.conversational, system=args.system,
        )  # fmt: skip
    except OSError as error:
        print(f"error: --out {args.out}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(f"wrote {count} pairs to {args.out} (gold reward: {GOLD_REWARD_NAME})")
    return 0


def _shard(args: argparse.Namespace, rest: list[str]) -> int:
    from components.shard.__main__ import main

    return main(rest, prog="alignpipe data shard")


def _validate(args: argparse.Namespace, rest: list[str]) -> int:
    from components.core.data.tokenizers import TokenizerError
    from components.shard.sources import InputError
    from components.shard.validate import validate_files

    try:
        config = config_from_flags(ShardConfig, args)
        report = validate_files(args.files, config)
    except (InputError, TokenizerError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report.render(config))
    return 0 if report.passes(config) else 1
