"""Container entry point of the ppo stage: flags → PPOConfig → run."""

import sys

from components.core.entry import stage_main
from components.ppo.config import PPOConfig


def _run(config: PPOConfig, shards_dir: str, policy_dir: str, reward_dir: str, output: str) -> dict:
    from components.ppo.stage import run

    return run(config, shards_dir, policy_dir, reward_dir, output)


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        argv,
        prog="python -m components.ppo",
        description="Align a policy against a reward model and/or reward functions with PPO "
        "(jax.pmap over every local device), with KL control and guard rails that restore the "
        "last good checkpoint. Resumes from its own checkpoints when restarted.",
        config_cls=PPOConfig,
        paths={
            "shards_dir": "output folder of the shard stage (its train prompts are used)",
            "policy_dir": "policy model folder to start from (output of the sft stage)",
            "reward_dir": "reward model folder (output of the reward stage); may be left out "
            "when --reward-functions score the rollouts alone",
            "output": "model folder to write the aligned policy to",
        },
        run=_run,
        optional=("reward_dir",),
    )


if __name__ == "__main__":
    sys.exit(main())
