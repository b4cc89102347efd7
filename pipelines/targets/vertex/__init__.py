"""Vertex AI: TPU training tasks as custom jobs, and their retry."""
