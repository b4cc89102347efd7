"""Container entry point of the evaluate stage: flags → EvalConfig → run."""

import sys

from components.core.entry import stage_main
from components.evaluate.config import EvalConfig

PATHS = {
    "shards_dir": "output folder of the shard stage (its eval split is evaluated)",
    "policy_dir": "aligned policy model folder (the ppo stage's output)",
    "reference_dir": "reference policy model folder (the policy PPO started from)",
    "reward_dir": "reward model folder (the reward stage's output)",
    "output": "folder to write report.html, eval.json and metrics.json into",
}


def _run(config: EvalConfig, **paths: str) -> dict:
    from components.evaluate.stage import run

    return run(config, **paths)


def main(argv: list[str] | None = None, prog: str = "python -m components.evaluate") -> int:
    return stage_main(
        argv,
        prog=prog,
        description="Sample the aligned and reference policies on the held-out prompts "
        "(jax.pmap over every local device), measure win rate, reward, KL, lengths and gold "
        "reward, decide whether the aligned policy is blessed, and write an HTML report.",
        config_cls=EvalConfig,
        paths=PATHS,
        run=_run,
    )


if __name__ == "__main__":
    sys.exit(main())
