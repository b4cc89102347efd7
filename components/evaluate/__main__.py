"""Container entry point of the evaluate stage: flags → EvalConfig → run."""

import argparse
import sys

from components.core.entry import path_flag, run_stage
from components.core.flags import add_config_flags, add_renamed, config_from_flags
from components.evaluate.config import EvalConfig

PATHS = {
    "shards_dir": "output folder of the shard stage (its eval split is evaluated)",
    "policy_dir": "aligned policy model folder (the ppo or dpo stage's output)",
    "reference_dir": "reference policy model folder (the policy the aligned one started from)",
    "output": "folder to write report.html, eval.json and metrics.json into",
}
REWARD_HELP = (
    "reward model folder (the reward stage's output) that judges the responses; '' (the "
    "default): the gold reward (--gold-reward, else the data's built-in one) judges them: "
    "win rate, rewards and best-of-n selection by gold, no reward-model accuracy"
)
DESCRIPTION = (
    "Sample the aligned and reference policies on the held-out prompts (jax.pmap over every "
    "local device), measure win rate, reward, KL, lengths and gold reward, decide whether the "
    "aligned policy is blessed, and write an HTML report."
)


def _run(config: EvalConfig, **paths: str) -> dict:
    from components.evaluate.stage import run

    return run(config, **paths)


def main(argv: list[str] | None = None, prog: str = "python -m components.evaluate") -> int:
    # core.entry.stage_main makes every path required; the reward model is optional here.
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    for name, help_text in PATHS.items():
        flag = "--" + name.removesuffix("_dir").replace("_", "-")
        parser.add_argument(flag, dest=name, required=True, help=help_text)
    parser.add_argument(path_flag("reward_dir"), dest="reward_dir", default="", help=REWARD_HELP)
    add_renamed(parser, "--reward", path_flag("reward_dir"))
    parser.add_argument(
        "--anchor", dest="anchor_dir", default="",
        help="policy folder drift is measured from (KL to it, win rate and gold gain against "
        "it; gated by --max-anchor-kl); '' (the default): the reference",
    )  # fmt: skip
    add_config_flags(parser, EvalConfig)
    args = parser.parse_args(argv)
    paths = {name: getattr(args, name) for name in (*PATHS, "reward_dir", "anchor_dir")}
    return run_stage(lambda: _run(config_from_flags(EvalConfig, args), **paths))


if __name__ == "__main__":
    sys.exit(main())
