"""Local runs on kfp.local: running the pipeline, its log and summary."""
