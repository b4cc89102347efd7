"""Container entry point of the reward stage: flags → RewardConfig → run."""

import sys

from components.core.entry import stage_main
from components.reward.config import RewardConfig


def _run(config: RewardConfig, shards_dir: str, output: str) -> dict:
    from components.reward.stage import run

    return run(config, shards_dir, output)


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        argv,
        prog="python -m components.reward",
        description="Train a Bradley-Terry reward model on preference shards (jax.pmap over "
        "every local device). Resumes from its own checkpoints when restarted.",
        config_cls=RewardConfig,
        paths={"shards_dir": "output folder of the shard stage", "output": "model folder to write"},
        run=_run,
    )


if __name__ == "__main__":
    sys.exit(main())
