"""What outlives a run: promotion history, policy resolution, the model registry,
realignment and schedules."""
