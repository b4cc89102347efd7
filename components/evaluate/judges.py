"""Who scores the responses (win rate, rewards, best-of-n selection): the learned reward
model, or, when none is given, the gold reward itself."""

JUDGE_REWARD_MODEL = "reward_model"
JUDGE_GOLD = "gold"
JUDGES = (JUDGE_REWARD_MODEL, JUDGE_GOLD)
