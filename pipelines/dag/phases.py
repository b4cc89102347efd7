"""What each phase of each algorithm holds on one chip: the planner's per-program arithmetic.

A stage runs a few compiled programs one after another; each phase is one of them (or, for
sampling, a part of one), and holds on a chip

* its **program**: the program's arguments and temporaries, as XLA's ``memory_analysis()``
  counts them (``argument + temp``; pipelines/dag/compiled.py compiles the real ones), and
* what is **resident** beside it without being one of its arguments: the optimizer moments
  while the rollout samples, the frozen reference and reward model while PPO's update trains.

Phases per algorithm (``ALGORITHMS``):

    sft, reward    train       forward and backward of one batch, the AdamW update
    ppo, grpo,     prefill     the prompt's forward pass into the KV cache (one position's logits)
    rloo           decode      one token a step from the cache (one position's logits)
                   scoring     policy and reference log-probs and their exact KL, a logits
                               tile at a time; the reward model's (and the critic's) forward
                   update      policy (and critic) forward, backward and update on a minibatch
    dpo            reference   the frozen reference's log-probs of the batch
                   update      the policy's forward, backward and update on the batch
    evaluate       prefill, decode (one network at a time)

Prefill, decode and scoring are one compiled rollout program: XLA reuses the buffers of one
part in the next, so the program needs the largest of the three.

Bytes per parameter: a trained network holds fp32 parameters and two Adam moments as the
train step's arguments (12) and its gradients and update temporaries as temporaries (8:
memory.TRAINED_BYTES_PER_PARAM = 20 in all); a frozen one its fp32 parameters (4). With
``fsdp`` the state is divided by the chips and ``memory.gathered_bytes`` comes on top. With
LoRA the trained bytes count the adapters, and the frozen bases are held in the compute dtype.
"""

from __future__ import annotations

import dataclasses

from components.core.model.config import ModelConfig
from pipelines.dag import memory

RL = ("ppo", "grpo", "rloo")
ALGORITHMS = ("sft", "reward", *RL, "dpo", "evaluate")
TRAINED_ARGUMENT_BYTES = 12  # fp32 parameters and two Adam moments: the train step's arguments
MOMENT_BYTES = 8  # the two Adam moments, resident while the networks sample
# Per token of a rollout row, the update's batch: tokens and masks, log-probs of both
# networks, advantages, values and returns (int32/fp32).
RL_BATCH_FIELDS = 8
# Networks held in the rollout program: policy, reference, reward (ppo: and the critic).
ROLLOUT_NETWORKS = {"ppo": 4, "grpo": 3, "rloo": 3}
# The flag counting the reward models scored beside the judge (ppo/monitors.py: held whole,
# in the compute dtype, on every chip, through the whole run; evaluate loads one at a time).
MONITOR_MODELS = "monitor_models"


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase's bytes on a chip."""

    name: str
    program: float  # arguments + temporaries of the program running
    resident: float  # beside it, not its argument

    @property
    def total(self) -> float:
        return self.program + self.resident


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a stage's networks sit on the chips: replicated or in fsdp's chunks, full
    fine-tuning or LoRA adapters (``adapters``: one network's adapter parameters)."""

    chips: int
    hosts: int = 1
    fsdp: bool = False
    adapters: int | None = None

    def state(self, config: ModelConfig, *, trained: int, frozen: int) -> tuple[float, float]:
        """(argument, temporary) bytes of ``trained`` networks in training and ``frozen``
        frozen full networks; LoRA: ``trained`` adapter sets, ``frozen`` bases."""
        n, share = memory.param_count(config), self.chips if self.fsdp else 1
        if self.adapters is None:
            held = trained * TRAINED_ARGUMENT_BYTES * n + frozen * memory.FROZEN_BYTES_PER_PARAM * n
            return held / share, trained * (
                memory.TRAINED_BYTES_PER_PARAM - TRAINED_ARGUMENT_BYTES
            ) * n / share
        a = self.adapters + config.dim + 1  # an adapter set and its head, if any
        held = trained * TRAINED_ARGUMENT_BYTES * a + frozen * memory.compute_bytes(config) * n
        return held / share, trained * (
            memory.TRAINED_BYTES_PER_PARAM - TRAINED_ARGUMENT_BYTES
        ) * a / share

    def moments(self, config: ModelConfig, trained: int) -> float:
        """Adam moments of ``trained`` networks (LoRA: adapter sets) on a chip."""
        n = memory.param_count(config) if self.adapters is None else self.adapters
        return trained * MOMENT_BYTES * n / (self.chips if self.fsdp else 1)

    def casts(self, config: ModelConfig, program: str) -> float:
        """The embedding's copies cast to the compute dtype (memory.EMBEDDING_CASTS); with fsdp
        each device casts its chunk, and what it gathers stands for the whole copies."""
        return 0.0 if self.fsdp else memory.cast_bytes(config, program)

    def lookup(self, config: ModelConfig, sequences: int, length: int) -> float:
        """fsdp: Gemma 4's per-layer rows of every chip's tokens, looked up from the table's
        chunks (fsdp.sharded_rows) in float32; 0 otherwise."""
        if not (self.fsdp and config.per_layer_dim):
            return 0.0
        width = config.n_layers * config.per_layer_dim
        return self.chips * sequences * length * width * memory.PARAM_BYTES

    def gathered(self, config: ModelConfig, *, networks: int, trained: bool) -> float:
        if not self.fsdp:
            return 0.0
        return memory.gathered_bytes(
            config, networks=networks, trained=trained, adapters=self.adapters
        )


def _training(
    config: ModelConfig,
    place: Placement,
    temps: float,
    backward: float,
    *,
    program: str,
    lora: bool,
) -> float:
    """A train program's temporaries: the larger of the update (gradients and the update's
    temporaries, ``temps``) and the backward pass (the gradients, the embedding's gradient
    copies unless LoRA freezes it, its casts to the compute dtype, and the activations,
    ``backward``); ``program``: "train" (sft, reward, dpo's step) or "update" (RL's)."""
    # With fsdp the gathered gradient (Placement.gathered) is one of the copies.
    copies = memory.EMBEDDING_GRADIENTS[program] - (1 if place.fsdp else 0)
    gradients = 0 if lora else copies * memory.embedding_bytes(config, per_layer=not place.fsdp)
    return max(temps, temps / 2 + gradients + place.casts(config, program) + backward)


def _lora_bases(algorithm: str) -> int:
    """Frozen bases an algorithm holds under LoRA: the policy's (the reference is it with
    the adapters off) and, for RL, the reward model's (the critic's adapters sit on it)."""
    return 2 if algorithm in RL else 1


def phases(config: ModelConfig, algorithm: str, flags: dict, placement: Placement) -> list[Phase]:
    """Every phase of ``algorithm`` with the stage config ``flags`` (batch fields, lengths,
    ``prompt_len``) on a chip of ``placement``: the largest total is the stage's peak."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    lora = placement.adapters is not None and algorithm != "evaluate"
    place = placement if lora else dataclasses.replace(placement, adapters=None)
    if algorithm in ("sft", "reward"):
        return [_train(config, algorithm, flags, place, lora)]
    if algorithm == "dpo":
        return _dpo(config, flags, place, lora)
    return _sampling(config, algorithm, flags, place, lora)


def _train(config: ModelConfig, algorithm: str, flags: dict, place: Placement, lora: bool) -> Phase:
    per_chip = flags["batch_size"] // place.chips
    sequences = 2 * per_chip if algorithm == "reward" else per_chip  # chosen + rejected
    length = flags["max_len"]
    logits_len = 0 if algorithm == "reward" else length  # the reward head is a scalar
    held, temps = place.state(config, trained=1, frozen=1 if lora else 0)
    acts = memory.backward_bytes(config, sequences, length, logits_len=logits_len)
    temps = _training(config, place, temps, acts, program="train", lora=lora)
    batch = sequences * length * 3 * 4 + place.lookup(config, sequences, length)
    gathered = place.gathered(config, networks=1, trained=True)
    return Phase("train", held + temps + batch + gathered, 0.0)


def _dpo(config: ModelConfig, flags: dict, place: Placement, lora: bool) -> list[Phase]:
    sequences, length = 2 * flags["batch_size"] // place.chips, flags["max_len"]
    batch = sequences * length * 3 * 4 + place.lookup(config, sequences, length)
    # The reference: the frozen copy (LoRA: the base with the adapters off) scores the batch
    # beside the policy's train state.
    frozen, _ = place.state(config, trained=0, frozen=1)
    state, temps = place.state(config, trained=1, frozen=0)
    acts = memory.forward_bytes(
        config, sequences, length, logits_len=length, tiles=memory.INFERENCE_TILES
    ) + place.casts(config, "forward")
    gathered = place.gathered(config, networks=1, trained=False)
    reference = Phase("reference", frozen + acts + batch + gathered, 0.0 if lora else state)
    acts = memory.backward_bytes(config, sequences, length, logits_len=length)
    temps = _training(config, place, temps, acts, program="train", lora=lora)
    gathered = place.gathered(config, networks=1, trained=True)
    held = state + (frozen if lora else 0.0)
    update = Phase("update", held + temps + batch + gathered, 0.0 if lora else frozen)
    return [reference, update]


def _sampling(
    config: ModelConfig, algorithm: str, flags: dict, place: Placement, lora: bool
) -> list[Phase]:
    response, prompt = flags["max_new_tokens"], flags["prompt_len"]
    length = prompt + response
    if algorithm == "evaluate":
        # Every host evaluates every row, its batch spread over its own chips; one network's
        # program at a time, the others resident.
        sequences = -(-flags["batch_size"] // (place.chips // place.hosts))
        frozen, _ = place.state(config, trained=0, frozen=1)
        networks, resident, trained = 1, 2 * frozen, 0
    else:
        sequences = flags["rollout_batch_size"] // place.chips
        trained = 1 if algorithm in ("grpo", "rloo") else 2
        networks = ROLLOUT_NETWORKS[algorithm]
        if lora:  # the bases and every adapter set's weights (their moments are resident)
            bases, _ = place.state(config, trained=0, frozen=_lora_bases(algorithm))
            adapters = trained * (place.adapters + config.dim + 1) * memory.PARAM_BYTES
            frozen = bases + adapters / (place.chips if place.fsdp else 1)
        else:
            frozen, _ = place.state(config, trained=0, frozen=networks)
        resident = place.moments(config, trained)
    monitors = flags.get(MONITOR_MODELS, 0) * memory.param_count(config)
    monitors *= memory.compute_bytes(config)  # held in the compute dtype
    if algorithm == "evaluate":
        resident += monitors
    else:
        frozen += monitors
    prompts = sequences * prompt * 2 * 4
    gathered = place.gathered(config, networks=1, trained=False)
    casts = place.casts(config, "forward" if algorithm == "evaluate" else "rollout")
    held = frozen + prompts + gathered + casts
    cache = memory.kv_cache_bytes(config, sequences, length)
    # Prefill: the prompt's forward pass, logits of its last position only; each decode step
    # then holds one position's logits a sequence and one position's activations.
    one = memory.INFERENCE_TILES
    prefill = memory.forward_bytes(config, sequences, prompt, logits_len=1, tiles=one)
    decode = memory.forward_bytes(config, sequences, 1, logits_len=1, tiles=one)
    prefill += place.lookup(config, sequences, prompt)
    decode += place.lookup(config, sequences, 1)
    result = [
        Phase("prefill", held + cache + prefill, resident),
        Phase("decode", held + cache + decode, resident),
    ]
    if algorithm == "evaluate":
        return result
    # Scoring: one network's forward pass at a time, then the policy's and the reference's
    # logits a tile at a time for the log-probs and the exact KL (rollout.py, vocab_tiles.py).
    scoring = memory.forward_bytes(
        config, sequences, length, logits_len=response, tiles=memory.SCORING_TILES
    )
    if config.is_hybrid:  # XLA:CPU runs two networks' hybrid passes side by side
        scoring += memory.layer_forward_bytes(config, sequences, length)
    rows = sequences * length * RL_BATCH_FIELDS * 4
    scoring += place.lookup(config, sequences, length)
    result.append(Phase("scoring", held + scoring + rows, resident))
    # The update: policy (and critic) forward and backward on one minibatch, each holding its
    # outer tensors and their gradients; the reference and reward model (LoRA: their bases,
    # which the update reads, are its arguments) resident.
    minibatch = sequences // flags["minibatches"]
    held, temps = place.state(config, trained=trained, frozen=_lora_bases(algorithm) if lora else 0)
    # The policy's and the critic's passes run one after the other: the larger counts. A
    # hybrid stack's are overlapped by XLA:CPU: the critic's recomputed period beside.
    acts = memory.backward_bytes(config, minibatch, length, logits_len=response)
    if trained == 2:
        acts += memory.recompute_bytes(config, minibatch, length)
    temps = _training(config, place, temps, acts, program="update", lora=lora)
    gathered = place.gathered(config, networks=trained, trained=True)
    frozen, _ = place.state(config, trained=0, frozen=0 if lora else 2)
    gathered += place.lookup(config, minibatch, length)
    result.append(Phase("update", held + temps + rows + gathered, frozen + monitors))
    return result


def peak(phases_: list[Phase]) -> Phase:
    """The phase that needs the most."""
    return max(phases_, key=lambda phase: phase.total)
