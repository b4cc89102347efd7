"""Container entry point of the dpo stage: flags → DPOConfig → run."""

import sys

from components.core.entry import stage_main
from components.dpo.config import DPOConfig


def _run(config: DPOConfig, shards_dir: str, policy_dir: str, output: str) -> dict:
    from components.dpo.stage import run

    return run(config, shards_dir, policy_dir, output)


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        argv,
        prog="python -m components.dpo",
        description="Align a policy on preference pairs with DPO against its frozen copy "
        "(no reward model, no sampling; jax.pmap over every local device). Resumes from its "
        "own checkpoints when restarted.",
        config_cls=DPOConfig,
        paths={
            "shards_dir": "output folder of the shard stage (its preference pairs are used)",
            "policy_dir": "policy model folder to start from and keep as the frozen reference "
            "(output of the sft stage, or a Hugging Face folder)",
            "output": "model folder to write the aligned policy to",
        },
        run=_run,
    )


if __name__ == "__main__":
    sys.exit(main())
