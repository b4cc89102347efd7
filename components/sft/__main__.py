"""Container entry point of the sft stage: flags → SFTConfig → run."""

import sys

from components.core.entry import stage_main
from components.sft.config import SFTConfig


def _run(config: SFTConfig, shards_dir: str, output: str) -> dict:
    from components.sft.stage import run

    return run(config, shards_dir, output)


def main(argv: list[str] | None = None) -> int:
    return stage_main(
        argv,
        prog="python -m components.sft",
        description="Train the initial policy on the chosen responses of preference shards "
        "(jax.pmap over every local device). Resumes from its own checkpoints when restarted.",
        config_cls=SFTConfig,
        paths={"shards_dir": "output folder of the shard stage", "output": "model folder to write"},
        run=_run,
    )


if __name__ == "__main__":
    sys.exit(main())
