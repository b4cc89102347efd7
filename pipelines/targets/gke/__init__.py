"""Kubeflow on GKE: multi-host TPU tasks as JobSets, and their launcher."""
