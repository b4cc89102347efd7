"""Data: the shards' reader, tokenizers, the built-in task and gold rewards."""
