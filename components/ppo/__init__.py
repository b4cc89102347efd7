"""PPO stage: rollouts, advantages and clipped updates of the policy against a reward model."""
