"""Shard stage: preference files → validated, deduplicated, tokenized TFRecord shards."""

from components.shard.config import ShardConfig
from components.shard.stage import ShardError, run

__all__ = ["ShardConfig", "ShardError", "run"]
