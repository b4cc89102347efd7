"""Training: the loop, optimizer, pmap placement, fsdp, checkpoints, hosts, metrics."""
