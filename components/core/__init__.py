"""Shared JAX building blocks: model, data parallelism, checkpoints, input pipeline, metrics."""
