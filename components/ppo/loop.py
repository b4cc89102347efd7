"""The PPO loop: rollout, guard check, checkpoint, update, log; resumable and self-restoring.

Iteration ``k`` (0-based) rolls out the policy reached after ``k`` updates. The
guard judges that rollout first; only a good policy is checkpointed (at step
``k``, every ``save_every`` iterations, with the prompt position before its
batch), so the latest checkpoint is always a good policy to return to. A final
rollout after the last update checks the policy that becomes the output.

A guard trip restores the policy (and an EMA reference) of the latest checkpoint,
keeps the critic and the controller, raises ``kl_coef`` and goes on from the
same iteration with fresh prompts: steps only go forward, and the restoration is
an event in ``metrics.jsonl``.

Randomness is a pure function of (seed, iteration, restorations), and every
other input of an iteration (policy, critic, both optimizer states, reference,
KL controller, guard state, prompt position, score statistics) is in the checkpoint,
so a killed and restarted run ends with the same parameters as an uninterrupted one.
A resume whose configuration changes the KL controller's target, kind or gains takes
them from the configuration (kl_control.resume_kl_controller): it then continues
differently from an uninterrupted run with the old ones, as asked.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

from components.core import fileio
from components.core.data.prompts import TEXT_KEYS
from components.core.training import parallel
from components.core.training.checkpoint import TrainCheckpointer
from components.core.training.metrics import MetricsLogger
from components.core.training.optim import make_schedule
from components.ppo.checkpoints import ppo_checkpointer
from components.ppo.config import (
    STATUS_COMPLETED,
    STATUS_STOPPED_KL_GUARD,
    PPOConfig,
)
from components.ppo.guard import KL_METRIC, GuardState, KLGuard
from components.ppo.host_rewards import HostRewards
from components.ppo.kl_control import (
    KLControllerState,
    init_kl_controller,
    raise_kl_coef,
    resume_kl_controller,
)
from components.ppo.monitors import HELDOUT_SCORE, OveroptTracker
from components.ppo.networks import LoopResult, Networks
from components.ppo.overopt_settings import STATUS_STOPPED_OVEROPTIMISATION
from components.ppo.rollout import (
    Frozen,
    RolloutParams,
    make_rollout,
    make_rollout_phases,
)
from components.ppo.score_norm import SCORE_NORM_KEY
from components.ppo.selection import SELECTION_SCORE, HeldoutSelection
from components.ppo.update import PPOState, make_ema_update, make_update

log = logging.getLogger(__name__)
# The checkpoint meta entry holding the reference's mean response length.
REFERENCE_LENGTH_KEY = "reference_response_length"
OVEROPT_KEY = "overoptimisation"  # the monitors' tracker (monitors.OveroptTracker)

PyTree = Any


# Compiled phases by (graphs, config, ids, norm): repeated runs in one process (tests, a
# guard-free resume) reuse the compiled rollout and update instead of tracing them again.
_PHASES: dict[tuple, tuple[Any, Any, Any]] = {}
_PHASES_KEPT = 4


def compiled_phases(config: PPOConfig, nets: Networks) -> tuple[Any, Any, Any]:
    """The pmapped rollout, update and EMA functions of this configuration (cached). With
    reward functions the rollout is two programs (rollout.RolloutPhases), scored between."""
    key = (nets.models, dataclasses.astuple(config), nets.ids, nets.norm, nets.monitor_spec)
    if key not in _PHASES:
        if len(_PHASES) >= _PHASES_KEPT:
            _PHASES.pop(next(iter(_PHASES)))
        ema = make_ema_update(config.ref_ema_decay) if config.ref_ema_decay else None
        make = make_rollout_phases if config.reward_functions else make_rollout
        rollout = make(nets.models, config, nets.ids, nets.norm, nets.monitor_spec)
        _PHASES[key] = (rollout, make_update(nets.models, config), ema)
    return _PHASES[key]


def host_floats(metrics: dict[str, jax.Array]) -> dict[str, float]:
    """Replicated pmap metrics as Python floats (this process's first device)."""
    return {name: float(value) for name, value in parallel.unreplicate(metrics).items()}


class PPOLoop:
    """One PPO run's mutable state and its phases."""

    def __init__(
        self,
        config: PPOConfig,
        nets: Networks,
        prompts: Any,
        output: str,
        checkpointer: TrainCheckpointer | None = None,
        host_rewards: HostRewards | None = None,
        selection: HeldoutSelection | None = None,
    ) -> None:
        """``checkpointer``: ``ppo_checkpointer``'s (built before the networks, whose score
        statistics a checkpoint holds), or None for one without input fingerprints;
        ``host_rewards``: the reward functions' scorer, when ``config.reward_functions``;
        ``selection``: what ranks each save (selection.py), else its rollout's held-out score."""
        if bool(config.reward_functions) != (host_rewards is not None):
            raise ValueError("reward_functions and host_rewards go together")
        self.config, self.nets, self.prompts, self.output = config, nets, prompts, output
        self.host_rewards, self.selection = host_rewards, selection
        self.rollout, self.update, self.ema = compiled_phases(config, nets)
        self.checkpointer = checkpointer or ppo_checkpointer(config, output)
        self.guard = KLGuard(
            kl_stop=config.kl_stop,
            max_restores=config.max_restores,
            lr_factor=config.restore_lr_factor,
            kl_factor=config.restore_kl_factor,
            patience=config.kl_stop_patience,
            work_dir=fileio.join(output, "work"),
        )
        self.key = np.asarray(jax.random.PRNGKey(config.seed))
        self.schedule = make_schedule(config.policy_optim())  # built once, for the lr metric
        self.last_saved = -1
        # The rollout figures of the latest good policy (saved with it): the output's figures.
        self.good_rollout: dict[str, float] = {}
        # The reference's mean response length: the first rollout's, whose policy is the
        # reference; each rollout's length is logged against it (a drift monitor).
        self.reference_length: float | None = None
        # The over-optimisation monitors' state (monitors.OveroptTracker); None without them.
        self.overopt = None
        if nets.monitor_spec is not None:
            self.overopt = OveroptTracker(
                config.heldout_patience, nets.monitor_spec.heldout, config.heldout_tolerance
            )
        self.monitors = None if nets.monitors is None else parallel.place(nets.monitors)
        self.template = PPOState.create(nets.policy, nets.critic, config)
        # LoRA's bases: placed once, read by every phase, never donated or checkpointed.
        self.frozen = None if nets.frozen is None else Frozen(*map(self._place, nets.frozen))
        self._set(self.template, nets.reference, self._initial_controller(), 0)
        self.tokens_per_iteration = config.rollout_batch_size * (
            config.prompt_len + config.max_new_tokens
        )

    def _initial_controller(self) -> KLControllerState:
        c = self.config
        kind = {"pid": "pid", "ziegler": "adaptive"}[c.kl_control] if c.adaptive_kl else "fixed"
        return init_kl_controller(
            kind, c.kl_coef, target=c.kl_target, horizon=c.kl_horizon_sequences,
            gains=(c.kl_p_gain, c.kl_i_gain), integral_delay=c.kl_i_delay,
        )  # fmt: skip

    def _place(self, tree: PyTree) -> PyTree:
        """``tree`` on the devices: replicated, or in chunks with ``fsdp``."""
        return parallel.place(tree, sharded=self.config.fsdp)

    def _set(self, state: PPOState, reference: PyTree, ctrl: KLControllerState, it: int) -> None:
        """Place host state on the devices."""
        self.state, self.reference = self._place(state), self._place(reference)
        self.controller, self.iteration = ctrl, it
        # Updates the current policy has had: the iteration, less those a restoration undid.
        self.policy_updates = it

    def _latest(self):
        """The latest checkpoint (after pending saves are on disk), or None."""
        self.checkpointer.wait()
        extra = {"reference": self.nets.reference} if self.ema else None
        return self.checkpointer.restore_latest(self.template, self.key, extra)

    def resume(self) -> int | None:
        """Continue from the latest checkpoint, if any; returns its iteration."""
        restored = self._latest()
        if restored is None:
            return None
        if restored.step > self.config.iterations:
            raise ValueError(
                f"iterations: {self.config.iterations}, but the checkpoint in "
                f"{self.checkpointer.directory} is at iteration {restored.step}; pass "
                f"--iterations {restored.step} or more to continue it, or "
                f"{self.checkpointer.start_over()}"
            )
        reference = restored.extra_trees["reference"] if self.ema else self.nets.reference
        meta = restored.extra_json
        # The configuration's target, kind and gains; the checkpoint's state of the same kind.
        saved = KLControllerState.from_json_dict(meta["kl_controller"])
        ctrl = resume_kl_controller(saved, self._initial_controller())
        self._set(restored.state, reference, ctrl, restored.step)
        self.policy_updates = int(meta.get("policy_updates", restored.step))
        if "guard" in meta:  # older checkpoints: guard.json as it was read
            self.guard.state = GuardState.from_json_dict(meta["guard"])
        self.good_rollout = dict(meta.get("rollout", {}))
        self.reference_length = meta.get(REFERENCE_LENGTH_KEY)
        if self.overopt is not None and OVEROPT_KEY in meta:
            self.overopt.restore(meta[OVEROPT_KEY])
        self.key = restored.rng
        self.prompts.restore(restored.data_position)
        self.last_saved = restored.step
        return restored.step

    def _save(self, position: dict[str, Any], tracker: dict[str, Any] | None) -> None:
        """Checkpoint the state at the start of this iteration (a policy that passed the
        guard), with ``tracker``, the over-optimisation tracker's state before this rollout."""
        if self.selection is not None:  # logged and saved with the rollout's figures
            metric = self.good_rollout[SELECTION_SCORE] = self.selection.score(
                self._policy(), self.monitors
            )
        else:
            metric = None if self.overopt is None else self.overopt.selection(self.good_rollout)
        extra = {"reference": parallel.checkpoint_view(self.reference)} if self.ema else None
        meta = {
            "kl_controller": self.controller.to_json_dict(),
            "guard": self.guard.state.to_json_dict(),
            "rollout": self.good_rollout,
            REFERENCE_LENGTH_KEY: self.reference_length,
            "policy_updates": self.policy_updates,
            **({} if tracker is None else {OVEROPT_KEY: tracker}),
            # Read back before the networks are built on resume (score_norm.saved_score_stats).
            SCORE_NORM_KEY: {
                "source": self.config.score_norm,
                "mean": self.nets.norm.mean,
                "std": self.nets.norm.std,
                "quantiles": list(self.nets.norm.quantiles),
            },
        }
        self.checkpointer.save(
            self.iteration,
            state=parallel.checkpoint_view(self.state),
            chunks=jax.device_count() if self.config.fsdp else 0,
            rng=self.key,
            data_position=position,
            extra_trees=extra,
            extra_json=meta,
            force=True,
            metric=metric,
        )
        self.last_saved = self.iteration

    def _policy(self) -> PyTree:
        """The current policy's whole parameters, placed (LoRA: adapters and base joined)."""
        if self.nets.frozen is None:
            return self.state.policy.params
        host = parallel.unreplicate(self.state.policy.params)
        return self._place(self.nets.whole_policy(host))

    def _save_due(self, stopping: bool = False) -> bool:
        """Whether this iteration's good policy is to be checkpointed."""
        if self.iteration <= self.last_saved:
            return False
        last = self.iteration == self.config.iterations or stopping
        return (
            last
            or self.last_saved < 0
            or self.iteration - self.last_saved >= self.config.save_every
        )

    def _rng(self, phase: int) -> jax.Array:
        """The key of this iteration's phase: a function of seed, iteration and restorations."""
        key = jax.random.fold_in(jax.random.fold_in(self.key, self.iteration), phase)
        return jax.random.fold_in(key, self.guard.state.restores)

    def _rollout(self) -> tuple[dict, dict[str, float], KLControllerState, float]:
        """Sample and score this iteration's batch; returns batch, metrics, the controller
        after observing it (rollout.rollout_step), seconds."""
        start = time.perf_counter()
        critic = self.state.critic
        params = RolloutParams(
            policy=self.state.policy.params,
            reference=self.reference,
            critic=None if critic is None else critic.params,
            reward=self.reward,
            frozen=self.frozen,
            monitors=self.monitors,
        )
        prompts = next(self.prompts)
        if self.config.uses_groups:
            # Each prompt's group side by side: a device holds whole groups (config checks).
            size = self.config.group_size
            prompts = {name: np.repeat(rows, size, axis=0) for name, rows in prompts.items()}
        texts = {name: prompts.pop(name) for name in TEXT_KEYS if name in prompts}
        prompts = parallel.shard_batch(prompts)
        if self.host_rewards is None:
            batch, metrics, controller = self.rollout(
                params, prompts, self._rng(0), self.controller
            )
            metrics = host_floats(metrics)  # waits for the devices
        else:
            batch, metrics, controller = self._scored_rollout(params, prompts, texts)
        return batch, metrics, parallel.unreplicate(controller), time.perf_counter() - start

    def _scored_rollout(
        self, params: RolloutParams, prompts: dict, texts: dict[str, np.ndarray]
    ) -> tuple[dict, dict[str, float], KLControllerState]:
        """Sample on the devices, score this host's rows with the reward functions, finish
        on the devices (rollout.RolloutPhases); the functions' metrics join the rollout's."""
        batch, extra, controller = self.rollout.sample(
            params, prompts, self._rng(0), self.controller
        )
        tokens = np.asarray(batch["response_tokens"])  # waits for the devices
        shape = tokens.shape[:2]
        mask = np.asarray(batch["response_mask"]).reshape(-1, tokens.shape[-1])
        rewards = self.host_rewards(texts, tokens.reshape(-1, tokens.shape[-1]), mask)
        per_function = rewards.per_function.astype(np.float32).reshape(*shape, -1)
        observed = parallel.unreplicate(controller)  # its coefficient weighs this rollout
        batch, metrics = self.rollout.finish(batch, extra, per_function, observed)
        stats = parallel.unreplicate(metrics.pop("functions"))  # global: over every host
        metrics = host_floats(metrics)
        for i, function in enumerate(self.host_rewards.functions):
            metrics[f"rewards/{function.name}/mean"] = float(stats["means"][i])
            metrics[f"rewards/{function.name}/std"] = float(stats["stds"][i])
        metrics["reward"] = float(stats["reward"])
        metrics["rewards/unscorable_fraction"] = float(stats["unscorable_fraction"])
        metrics["time/reward_functions_s"] = rewards.seconds  # this host's
        return batch, metrics, controller

    def _update(self, batch: dict) -> tuple[dict[str, float], float]:
        """All PPO epochs on ``batch``; returns metrics and seconds."""
        start = time.perf_counter()
        lr_scale = np.float32(self.guard.state.lr_scale)
        kl_coef = np.float32(self.controller.kl_coef)
        self.state, metrics = self.update(
            self.state, batch, self._rng(1), lr_scale, kl_coef, self.frozen
        )
        metrics = host_floats(metrics)
        return metrics, time.perf_counter() - start

    def _trip(self, reason: str, logger: MetricsLogger) -> str | None:
        """Restore the last good policy; returns the final status when the run must stop."""
        stopped = self.guard.exhausted
        restored = self._latest()
        if restored is None:
            raise FloatingPointError(
                f"ppo: {reason} at iteration {self.iteration} before any good checkpoint "
                "existed; check the policy and reward artifacts, or lower learning_rate"
            )
        # The critic keeps what it learned: its values were fitted to returns, not to the KL.
        self.state = self.state.replace(policy=self._place(restored.state.policy))
        if self.ema:
            self.reference = self._place(restored.extra_trees["reference"])
        if not stopped:
            self.controller = raise_kl_coef(self.controller, self.config.restore_kl_factor)
        self.policy_updates = int(restored.extra_json.get("policy_updates", restored.step))
        event = self.guard.record(
            iteration=self.iteration, reason=reason, restored_to=restored.step, stopped=stopped,
            policy_updates=self.policy_updates, kl_coef=float(self.controller.kl_coef),
        )  # fmt: skip
        # At step iteration + 1, like this iteration's metrics would be: a resume from a
        # checkpoint taken before the trip drops it, and the replay records it again.
        logger.event(self.iteration + 1, f"guard_{event['action']}", **event)
        if not stopped:
            return None
        self.iteration = restored.step
        self.good_rollout = dict(restored.extra_json.get("rollout", {}))
        return STATUS_STOPPED_KL_GUARD

    def _iteration_metrics(
        self, rollout: dict[str, float], update: dict[str, float], seconds: tuple[float, float]
    ) -> dict[str, float]:
        """Everything logged for one iteration."""
        t_rollout, t_update = seconds
        steps = (self.iteration + 1) * self.config.ppo_epochs * self.config.minibatches
        metrics = {**rollout, **update}
        metrics.update(
            {
                "lr": float(self.schedule(steps - 1)) * self.guard.state.lr_scale,
                "objective/kl_coef": float(self.controller.kl_coef),
                "episode": float((self.iteration + 1) * self.config.rollout_batch_size),
                "guard/restores": float(self.guard.state.restores),
                "guard/lr_scale": self.guard.state.lr_scale,
                "time/rollout_s": t_rollout,
                "time/update_s": t_update,
                "time/rollout_tokens_per_s": self.tokens_per_iteration / t_rollout,
                "time/update_tokens_per_s": self.tokens_per_iteration / t_update,
                "time/tokens_per_s": self.tokens_per_iteration / (t_rollout + t_update),
            }
        )
        if self.config.adaptive_kl:  # the report draws the KL against it
            metrics["objective/kl_target"] = self.config.kl_target
        return metrics

    def _step(self, logger: MetricsLogger) -> str | None:
        """One iteration; returns a final status when the run ends, else None."""
        position = self.prompts.position()
        batch, rollout, controller, t_rollout = self._rollout()
        if self.reference_length is None and self.iteration == 0:
            self.reference_length = rollout["response_length"]
        if self.reference_length:  # None: resumed from a checkpoint that did not keep it
            rollout["response_length_ratio"] = rollout["response_length"] / self.reference_length
        stopping = False
        if self.overopt is not None:
            rollout.update(self.overopt.gains(rollout))
        last = self.iteration == self.config.iterations
        verdict = self.guard.judge_rollout(rollout, final=last)
        reason = verdict.trip
        if reason is None:
            if verdict.good:
                # A resume's replay of its save: the score the save was ranked by goes on.
                if self.iteration == self.last_saved and SELECTION_SCORE in self.good_rollout:
                    rollout[SELECTION_SCORE] = self.good_rollout[SELECTION_SCORE]
                self.good_rollout = rollout
                tracker = None
                if self.overopt is not None:
                    tracker = self.overopt.state()
                    stopping = self.overopt.observe(self.iteration, rollout)
                # With the controller and the tracker before they saw this rollout: a resume
                # rolls out again, and would count it twice.
                if self._save_due(stopping):
                    self._save(position, tracker)
            if last:
                return STATUS_COMPLETED
            if stopping:
                logger.event(self.iteration + 1, "overoptimisation_stop", **self.overopt.state())
                log.info("ppo: %s", self.overopt.stop_reason(self.iteration))
                return STATUS_STOPPED_OVEROPTIMISATION
            # The coefficient this rollout's penalty was weighed with (grpo: the update's).
            self.controller = controller
            update, t_update = self._update(batch)
            reason = self.guard.update_trip(update)
        if reason is not None:
            return self._trip(reason, logger)
        metrics = self._iteration_metrics(rollout, update, (t_rollout, t_update))
        if self.ema is not None:
            self.reference = self.ema(self.reference, self.state.policy.params)
        self.iteration += 1
        self.policy_updates += 1
        logger.log(self.iteration, metrics)
        return None

    def run(self, reward_params: PyTree) -> LoopResult:
        """Iterate to ``config.iterations`` (or a guard stop), resuming from checkpoints."""
        self.reward = self._place(reward_params)
        resumed = self.resume()
        if resumed is not None:
            log.info("ppo: resuming from iteration %d", resumed)
        logger = MetricsLogger(
            self.output,
            total_steps=self.config.iterations,
            stage="ppo",
            resume_step=resumed or 0,
            config=self.config,
        )
        status = None
        with self.checkpointer, logger:
            while status is None:
                status = self._step(logger)
        host = parallel.unreplicate(self.state)
        policy, selected = host.policy.params, None
        if self.checkpointer.best_step() is not None:
            policy, selected = self._select(policy)
        # The figures of the policy this run outputs, not of a later one the guard discarded.
        summary = {
            **self.good_rollout,
            "step": float(self.policy_updates),
            "iterations_run": float(self.iteration),
            "guard/restores": float(self.guard.state.restores),
            "objective/kl_coef": float(self.controller.kl_coef),
        }
        # None only for a run resumed from a checkpoint written before they held the figures.
        final_kl = self.good_rollout.get(KL_METRIC)
        return LoopResult(
            self.nets.whole_policy(policy),
            self.policy_updates,
            status,
            summary,
            self.guard.state.events,
            final_kl,
            selected,
        )

    def _select(self, last_policy: PyTree) -> tuple[PyTree, dict[str, float]]:
        """The saved policy ranked highest (select_checkpoint heldout: by selection.py's
        score, or by its rollout's held-out score), its rollout figures and updates in place
        of the last's; and what was chosen, with both policies' scores."""
        best = self.checkpointer.best_step()
        last = self.good_rollout
        selected = {"iteration": float(best), "last_iteration": float(self.iteration)}
        if best != self.iteration:
            extra = {"reference": self.nets.reference} if self.ema else None
            restored = self.checkpointer.restore_latest(self.template, self.key, extra, step=best)
            self.good_rollout = dict(restored.extra_json.get("rollout", {}))
            self.policy_updates = int(restored.extra_json.get("policy_updates", best))
        for name, key in (("heldout_score", HELDOUT_SCORE), ("selection_score", SELECTION_SCORE)):
            if key in last:
                selected.update({name: self.good_rollout.get(key), f"last_{name}": last[key]})
        if best == self.iteration:
            return last_policy, selected
        ranked = "selection_score" if "selection_score" in selected else "heldout_score"
        log.info(
            "ppo: output the policy of iteration %d (%s %.4g; the last, iteration %d, %.4g)",
            best, ranked, selected.get(ranked, float("nan")), self.iteration,
            selected.get(f"last_{ranked}", float("nan")),
        )  # fmt: skip
        return restored.state.policy.params, selected
