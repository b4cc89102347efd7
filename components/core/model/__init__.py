"""The model: decoder layers, the transformer, its config, sampling, scoring, artifacts."""
