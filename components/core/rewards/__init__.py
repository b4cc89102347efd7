"""Reward functions: verifiable rewards scored on the host beside or instead of the reward
model (TRL's ``reward_funcs``): built-ins, loading by spec and weights, batch scoring."""
