"""Evaluate stage: win rate, KL and rewards of the aligned policy, a promotion gate, a report."""
