"""The evaluate stage's configuration: the one place its defaults live."""

from __future__ import annotations

import dataclasses
import math

from components.core import builtin_task
from components.core.flags import field


@dataclasses.dataclass(slots=True, kw_only=True)
class EvalConfig:
    """How the aligned policy is sampled, measured against its reference and gated."""

    samples_per_prompt: int = field(
        1, help="responses drawn per prompt and policy; per-prompt reward is their mean"
    )
    greedy: bool = field(False, help="decode greedily (temperature is then ignored)")
    temperature: float = field(1.0, help="sampling temperature when not greedy")
    max_new_tokens: int = field(
        0, help="longest response in tokens (EOS included); 0 = the longest in the data"
    )
    max_eval_prompts: int = field(256, help="eval-split prompts used, at most")
    batch_size: int = field(
        64,
        help="sequences generated or scored per step over all local devices (rounded up to a "
        "multiple of the device count); bounds memory, not results",
    )
    seed: int = field(0, help="seed of sampling, the bootstrap and the report's sample choice")
    fsdp: bool = field(
        False,
        help="hold the three models in chunks over all devices, gathering one layer at a time "
        "(for models whose float32 copies do not fit a chip three times)",
    )
    bootstrap_samples: int = field(
        1000, help="percentile-bootstrap resamples (of prompts) behind every interval"
    )
    confidence: float = field(0.95, help="coverage of the bootstrap intervals, in (0, 1)")
    min_win_rate_lower: float = field(
        0.5,
        help="blessing requires the win rate's lower interval bound >= this "
        "(0.5: the aligned policy is not worse than its reference)",
    )
    # Per token rather than per sequence: the threshold then keeps its meaning when
    # max_new_tokens or the response lengths change (PPO's objective/kl is per sequence).
    max_kl: float = field(
        0.5,
        help="blessing requires KL(aligned || reference) <= this, in nats per response token "
        "(k1 estimate on aligned samples); inf disables the check",
    )
    num_report_samples: int = field(20, help="prompts shown with both responses in the report")
    gold_reward: str = field(
        "",
        help=f"gold reward function to score responses with (e.g. "
        f"{builtin_task.GOLD_REWARD_NAME}); empty: no gold measures",
    )

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(
                f"max_new_tokens: {self.max_new_tokens} must be >= 0 (0 = from the data)"
            )
        for name in ("samples_per_prompt", "max_eval_prompts", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be at least 1")
        if not self.greedy and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature: {self.temperature} must be a finite number > 0; "
                "set greedy=True for deterministic decoding"
            )
        if self.bootstrap_samples < 1:
            raise ValueError(
                f"bootstrap_samples: {self.bootstrap_samples} must be at least 1 "
                "(1000 or more gives stable intervals)"
            )
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence: {self.confidence} must be in (0, 1), e.g. 0.95")
        if not 0.0 <= self.min_win_rate_lower <= 1.0:
            raise ValueError(
                f"min_win_rate_lower: {self.min_win_rate_lower} must be in [0, 1] "
                "(a win rate); 0 disables the check"
            )
        if math.isnan(self.max_kl) or self.max_kl < 0:
            raise ValueError(
                f"max_kl: {self.max_kl} must be >= 0 nats per token; inf disables the check"
            )
        if self.num_report_samples < 0:
            raise ValueError(f"num_report_samples: {self.num_report_samples} must be >= 0")
        if self.gold_reward:
            try:
                builtin_task.gold_reward_fn(self.gold_reward)
            except KeyError as error:
                raise ValueError(
                    f"gold_reward: {error.args[0]}; pass one of those or '' for none"
                ) from None
