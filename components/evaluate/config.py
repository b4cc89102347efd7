"""The evaluate stage's configuration: the one place its defaults live."""

from __future__ import annotations

import dataclasses
import math

from components.core.config import TrackingSettings, check_finite
from components.core.data import builtin_task
from components.core.data.gold import validate_gold_reward
from components.core.flags import field
from components.core.rewards.functions import load_one, parse_specs, parse_weights

# Samples per prompt and policy: each adds a paired comparison per prompt. Measured on a demo
# run (88 eval prompts, win rate 0.77): the 95% interval is ±0.060 with 1 sample, ±0.044 with
# 2, ±0.031 with 4. For 200 prompts and a policy near parity (the widest case, Var 0.25) 4
# samples give at most ±1.96·sqrt(0.25 / 800) = ±0.035 plus the prompts' own spread.
DEFAULT_SAMPLES_PER_PROMPT = 4


@dataclasses.dataclass(slots=True, kw_only=True)
class EvalConfig(TrackingSettings):
    """How the aligned policy is sampled, measured against its reference and gated."""

    samples_per_prompt: int = field(
        DEFAULT_SAMPLES_PER_PROMPT,
        help="responses drawn per prompt and policy; the win rate compares each aligned "
        "sample with every reference draw of another key (independent pairs), per-prompt "
        "reward is their mean",
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
        help="blessing requires the win rate's lower interval bound > this, strictly "
        "(0.5: the aligned policy beats its reference; an unchanged one passes only when "
        "its interval misses low, (1 - confidence) / 2 of the time)",
    )
    # Per token rather than per sequence: the threshold then keeps its meaning when
    # max_new_tokens or the response lengths change (PPO's objective/kl is per sequence).
    max_kl: float = field(
        0.5,
        help="blessing requires KL(aligned || reference) <= this, in nats per response token "
        "(k3 estimate on aligned samples); inf disables the check (a pipeline parameter "
        "must be finite: 1e9)",
    )
    # Finite by default: a chain of runs may drift further than one run (max_kl each), but
    # not without bound. Twice the per-run limit lets a few full-budget runs through; past
    # it a policy's tokens are on average e^1 = 2.7x likelier under it than under the
    # anchor, which has stopped being a small step from the original.
    max_anchor_kl: float = field(
        1.0,
        help="blessing requires KL(aligned || anchor) <= this, in nats per response token: "
        "drift from the anchor (the first promoted policy) across runs; inf disables the check "
        "(a pipeline parameter must be finite: 1e9)",
    )
    # Over-optimisation rules (overoptimisation.py), each judged by the model it names;
    # the first two and the last need the reward artifact's held-out model or ensemble.
    min_heldout_gain: float = field(
        0.0,
        help="blessing requires the held-out reward model's mean gain (in its eval stds) of "
        "the aligned policy over the reference > this, strictly, when the reward artifact has "
        "one (pipeline heldout_reward or heldout_data_uri); -inf disables the check",
    )
    max_reward_gap: float = field(
        1.0,
        help="blessing requires the judge's gain minus the held-out reward model's (both in "
        "their eval stds) <= this: what the proxy credits that an independent judge does not; "
        "inf disables the check",
    )
    max_length_ratio: float = field(
        3.0,
        help="blessing requires the aligned policy's mean response length <= this times the "
        "reference's (length is what reward models are most often gamed with); inf disables",
    )
    max_disagreement: float = field(
        2.0,
        help="blessing requires the reward ensemble's spread on the aligned samples <= this "
        "times its spread on the reference's, when the reward artifact has an ensemble "
        "(reward ensemble_size > 1); inf disables the check",
    )
    num_report_samples: int = field(20, help="prompts shown with both responses in the report")
    gold_reward: str = field(
        "",
        help=f"gold reward to score responses with: a built-in name (e.g. "
        f"{builtin_task.GOLD_REWARD_NAME}), PATH.py:FUNCTION or MODULE:FUNCTION, a function "
        "(prompt: str, response: str) -> float; empty: the data's built-in one, if any",
    )
    best_of_n: str | tuple[int, ...] = field(
        "1,2,4,8,16",
        help="best-of-n baseline: n responses of the reference, the reward model keeps its "
        "best; comma-separated n (1 included), empty or greedy: no baseline",
    )
    # The verifiable evaluation (verifiable_stage.py): setting reward_functions switches to it.
    reward_functions: str = field(
        "",
        help="reward functions, comma-separated, as the ppo stage's (builtin/exact-match, "
        "PATH.py:FUNCTION, MODULE:FUNCTION); when set, the evaluation is the verifiable one: "
        "accuracy and pass@k by the first function (the verifier: full marks, >= 1.0, is "
        "correct), no reward model; '' = the preference evaluation (win rate)",
    )
    reward_weights: str = field(
        "", help="weights of reward_functions, comma-separated, one each ('' = 1.0 each)"
    )
    pass_samples: int = field(
        8,
        help="verifiable evaluation: responses sampled per prompt at temperature for pass@k "
        "(k = 1, 2, 4, ... up to it, and it); 0 = the greedy response alone",
    )
    min_accuracy_gain: float = field(
        0.0,
        help="verifiable evaluation: blessing requires the lower interval bound of the accuracy "
        "gain over the reference > this, strictly (0: the policy solves more prompts)",
    )

    def __post_init__(self) -> None:
        TrackingSettings.__post_init__(self)
        check_finite(
            self,
            allow_inf=(
                "max_kl", "max_anchor_kl", "min_heldout_gain", "max_reward_gap",
                "max_length_ratio", "max_disagreement",
            ),
        )  # fmt: skip
        for name in ("max_reward_gap", "max_length_ratio", "max_disagreement"):
            if math.isnan(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 0; inf disables it")
        if self.seed < 0:
            raise ValueError(f"seed: {self.seed} must be >= 0")
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
                f"min_win_rate_lower: {self.min_win_rate_lower} must be in [0, 1] (a win "
                "rate; the bound must exceed it, so 0 still refuses a policy that lost every "
                "pair), e.g. 0.5"
            )
        if self.min_heldout_gain == math.inf:
            raise ValueError(
                "min_heldout_gain: inf would refuse every policy (the gain must exceed it); "
                "-inf disables the check, e.g. 0.0"
            )
        if math.isnan(self.max_kl) or self.max_kl < 0:
            raise ValueError(
                f"max_kl: {self.max_kl} must be >= 0 nats per token; inf disables the check"
            )
        if math.isnan(self.max_anchor_kl) or self.max_anchor_kl < 0:
            raise ValueError(
                f"max_anchor_kl: {self.max_anchor_kl} must be >= 0 nats per token; "
                "inf disables the check"
            )
        if self.num_report_samples < 0:
            raise ValueError(f"num_report_samples: {self.num_report_samples} must be >= 0")
        try:
            validate_gold_reward(self.gold_reward)
        except ValueError as error:
            raise ValueError(f"gold_reward: {error}") from None
        self.best_of_n_sizes()  # refuses a malformed list early
        self._check_verifiable()

    def _check_verifiable(self) -> None:
        """The verifiable evaluation's fields: specs without loading user code (the stage
        does), weights that match them, a sample count, a gain threshold a gain can pass."""
        specs = parse_specs(self.reward_functions)
        for spec in specs:
            if spec.startswith("builtin/") or ":" not in spec:
                try:
                    load_one(spec)
                except ValueError as error:
                    raise ValueError(f"reward_functions: {error}") from None
        if self.reward_weights.strip() and not specs:
            raise ValueError(
                f"reward_weights: {self.reward_weights!r} weighs no reward function; give "
                "reward_functions too, or leave reward_weights ''"
            )
        parse_weights(self.reward_weights, len(specs))  # its messages name reward_weights
        if self.pass_samples < 0:
            raise ValueError(
                f"pass_samples: {self.pass_samples} must be >= 0 (0 = greedy responses only)"
            )
        if specs and self.greedy and self.pass_samples:
            raise ValueError(
                f"pass_samples: {self.pass_samples} samples per prompt need greedy=False (greedy "
                "decoding would draw one response that many times); set pass_samples=0 for the "
                "greedy response alone"
            )
        if not -1.0 <= self.min_accuracy_gain < 1.0:
            raise ValueError(
                f"min_accuracy_gain: {self.min_accuracy_gain} must be in [-1, 1) (a difference "
                "of two accuracies that a gain can exceed), e.g. 0.0"
            )

    def best_of_n_sizes(self) -> tuple[int, ...]:
        """The best-of-n sizes, ascending, or () when the baseline is off (empty or greedy)."""
        spec = self.best_of_n
        try:
            parts = spec.split(",") if isinstance(spec, str) else list(spec)
            sizes = sorted({int(part) for part in parts if str(part).strip()})
        except (TypeError, ValueError):
            sizes = [0]
        if sizes and (sizes[0] != 1 or any(isinstance(p, bool) for p in parts)):
            raise ValueError(
                f"best_of_n: {spec!r} must be whole numbers >= 1 that include 1 (the "
                "reference itself, every gain's baseline), e.g. '1,2,4,8,16'; '' for none"
            )
        return () if self.greedy else tuple(sizes)
