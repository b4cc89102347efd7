"""The sft stage: warm-start a policy on the chosen responses and export it."""

from __future__ import annotations

from typing import Any

from components.core import fileio
from components.core.training.trainer import train_on_preferences
from components.hf.importer import remove_import, resolve_base
from components.sft.config import SFTConfig
from components.sft.train import make_sft_eval_sums, make_sft_loss, summarize_eval


def run(config: SFTConfig, shards_dir: str, output: str) -> dict[str, Any]:
    """Train the initial policy on ``shards_dir``; write the model artifact to ``output``."""
    trained = train_on_preferences(
        config,
        shards_dir,
        output,
        stage="sft",
        # A Hugging Face folder is imported once into the task's work folder.
        base=resolve_base(config.base_policy, fileio.join(output, "work")),
        scalar_head=False,
        make_loss=make_sft_loss,
        make_eval_sums=make_sft_eval_sums,
        summarize_eval=summarize_eval,
        # Fingerprinted as given: an HF folder's import is redone in a new output.
        inputs={"--base-policy": config.base_policy},
    )
    trained.save(output, "sft")
    remove_import(fileio.join(output, "work"))
    return trained.summary()
