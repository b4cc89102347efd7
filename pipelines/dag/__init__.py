"""The KFP pipeline: its DAG, the components wrapping the stages, the parameter table,
run presets and preflight."""
