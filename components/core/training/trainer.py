"""The training loop shared by the sft and reward stages.

Resumes by itself from the latest complete checkpoint (state, RNG, data position) in
its training-state folder (``checkpoint.training_state_dir``: the durable folder the
pipeline keys by run and task, else the artifact's work folder), runs the pmapped
step, evaluates every ``eval_every`` steps, logs metrics, and aborts with a clear
message after ``max_nonfinite_steps`` non-finite steps in a row, the last good
checkpoint kept.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from components.core import fileio
from components.core.model import lora
from components.core.training import fsdp, parallel
from components.core.training.checkpoint import TrainCheckpointer, training_state_dir
from components.core.training.config import TrainConfig
from components.core.training.metrics import MetricsLogger
from components.core.training.optim import make_schedule

log = logging.getLogger(__name__)
PyTree = Any
EvalFn = Callable[[PyTree], dict[str, float]]


@dataclasses.dataclass(slots=True)
class FitResult:
    """What a finished training run hands back to its stage."""

    params: PyTree  # host copy
    step: int
    metrics: dict[str, float]
    resumed_from: int | None


def fit(
    *,
    config: TrainConfig,
    output: str,
    stage: str,
    params: PyTree,
    loss_fn: parallel.LossFn,
    train_data: Iterator[dict[str, np.ndarray]],
    evaluate: EvalFn | None = None,
    frozen: PyTree | None = None,
    inputs: dict[str, str] | None = None,
) -> FitResult:
    """Train ``params`` with ``loss_fn`` on ``train_data``; resume from the latest checkpoint
    in ``training_state_dir(output)``.

    ``frozen`` (LoRA's base, lora.split) is read by the loss and never trained, saved in a
    checkpoint or placed twice; the loss, ``evaluate`` and the result see it joined back.
    ``inputs`` (flag → folder: the shards, the base model) are fingerprinted into the
    checkpoints' identity, so a resume with other ones is refused.
    """
    optimizer = config.optim()  # AdamW, applied by optim.adamw_step
    schedule = make_schedule(optimizer)  # built once: the loop logs its value per step
    state = parallel.TrainState.create(params, optimizer)
    rng = np.asarray(jax.random.PRNGKey(config.seed))
    identity = {"stage": stage, "batch_size": config.batch_size, "seed": config.seed}
    directory = training_state_dir(output)
    checkpointer = TrainCheckpointer(directory, config.checkpoint(), identity, inputs)
    restored = checkpointer.restore_latest(state, rng)
    start = 0
    if restored is not None:
        state, rng, start = restored.state, restored.rng, restored.step
        if start > config.steps:
            raise ValueError(
                f"steps: {config.steps}, but the checkpoint in {checkpointer.directory} is "
                f"at step {start}; pass --steps {start} or more to continue it, or "
                f"{checkpointer.start_over()} to start over"
            )
        train_data.restore(restored.data_position)
        log.info("%s: resuming from step %d of %s", stage, start, checkpointer.directory)
    step_fn = parallel.make_train_step(loss_fn, optimizer)
    guard = parallel.NonFiniteGuard(config.max_nonfinite_steps)
    placed = parallel.place(state, sharded=config.fsdp)
    placed_frozen = None if frozen is None else parallel.place(frozen, sharded=config.fsdp)
    final: dict[str, float] = {}
    logger = MetricsLogger(
        output, total_steps=config.steps, stage=stage, resume_step=start, config=config
    )
    with checkpointer, logger:
        batch = parallel.shard_batch(next(train_data)) if start < config.steps else None
        for step in range(start, config.steps):
            rng, step_rng = _split(rng)
            placed, metrics = step_fn(placed, batch, step_rng, placed_frozen)
            # The step runs on the devices (dispatch is asynchronous) while the host reads
            # the next batch; a checkpoint saves where this step's batch left the data.
            position = train_data.position()
            if step + 1 < config.steps:
                batch = parallel.shard_batch(next(train_data))
            metrics = {k: float(np.asarray(v)[0]) for k, v in metrics.items()}
            guard.update(step + 1, metrics["skipped"])
            metrics["learning_rate"] = float(schedule(step))  # the Hugging Face Trainer's name
            done = step + 1
            if evaluate is not None and (done % config.eval_every == 0 or done == config.steps):
                whole = lora.join(placed.params, placed_frozen)
                metrics.update({f"eval/{k}": v for k, v in evaluate(whole).items()})
            logger.log(done, metrics)
            if done % config.save_every == 0 or done == config.steps:
                checkpointer.save(
                    done,
                    state=parallel.checkpoint_view(placed),
                    rng=rng,
                    data_position=position,
                    force=True,
                    chunks=jax.device_count() if config.fsdp else 0,
                )
        final = logger.summary()
    host = parallel.unreplicate(placed)
    params = lora.join(host.params, frozen)
    return FitResult(params, int(host.step), final, None if restored is None else start)


def _split(rng: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Next carry key and this step's key, as raw uint32 keys (checkpoint-friendly)."""
    carry, step = jax.random.split(rng)
    return np.asarray(carry), np.asarray(step)


def streams(config: TrainConfig) -> tuple[list[int], int, int]:
    """This host's data streams, the batch each draws (per step), and the stream count.

    Stream *s* of *S* reads shards *s*, *s+S*, …; host *h* of *H* owns streams
    *h·S/H* … *(h+1)·S/H − 1*, so the global batch is the same for any *H* that divides *S*.
    """
    config.per_host_batch()  # refuses a batch that does not split over the devices
    return stream_shares(config.batch_size, config.data_streams)


def stream_shares(
    batch_size: int, data_streams: int, batch_name: str = "batch_size"
) -> tuple[list[int], int, int]:
    """This host's streams, the batch each draws, and the stream count (0 = one per host)."""
    hosts, host = jax.process_count(), jax.process_index()
    count = data_streams or hosts
    if count % hosts:
        raise ValueError(
            f"data_streams: {count} must be a multiple of the {hosts} hosts of this run"
        )
    if batch_size % count:
        raise ValueError(f"{batch_name}: {batch_size} must be a multiple of {count} streams")
    per_host = count // hosts
    return list(range(host * per_host, (host + 1) * per_host)), batch_size // count, count


class StreamBatches(Iterator[dict[str, np.ndarray]]):
    """This host's batch: one batch from each of its streams, concatenated in stream order."""

    def __init__(self, readers: list) -> None:
        self.readers = readers

    def __next__(self) -> dict[str, np.ndarray]:
        batches = [next(reader) for reader in self.readers]
        return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

    def position(self) -> dict[str, Any]:
        return {"streams": [reader.position() for reader in self.readers]}

    def restore(self, position: dict[str, Any]) -> None:
        """Continue from a :meth:`position` saved by any host layout of the same streams.

        Every stream draws one batch per step, so all saved streams hold the same count
        (the checkpoint keeps process 0's streams); each reader resumes from it, whichever
        streams this host now owns.
        """
        saved = position.get("streams", [position])  # PPO checkpoints before streams: one
        counts = {stream["batches_total"] for stream in saved}
        if len(counts) != 1:
            raise ValueError(f"the checkpoint's data streams are not in step: {sorted(counts)}")
        for reader in self.readers:
            reader.restore(saved[0])


def preference_streams(
    shards_dir: str, split: str, config: TrainConfig, *, shuffle: bool, repeat: bool
) -> StreamBatches:
    """Preference batches of this host's streams (see :func:`streams`)."""
    from components.core.data.input_pipeline import preference_dataset

    own, per_stream, total = streams(config)
    readers = [
        preference_dataset(
            shards_dir,
            split,
            batch_size=per_stream,
            max_len=config.max_len,
            seed=config.seed,
            host_index=s,
            host_count=total,
            shuffle=shuffle,
            repeat=repeat,
        )  # fmt: skip
        for s in own
    ]
    return StreamBatches(readers)


def eval_batch_count(manifest: dict[str, Any], split: str, config: TrainConfig) -> int:
    """Eval batches every stream can supply (from the manifest's per-shard counts).

    Every host must run the same number of eval batches, or the cross-host ``psum``
    of the eval step would wait on a host that ran out.
    """
    _, per_stream, total = streams(config)
    shards = manifest["splits"][split]["shards"]
    counts = [sum(s["pairs"] for s in shards[i::total]) // per_stream for i in range(total)]
    count = min(counts)
    if count == 0:
        raise ValueError(
            f"the {split} split has too few pairs for {total} stream(s) of {per_stream}; "
            "lower batch_size, raise eval_fraction in the shard stage, or use more data"
        )
    return min(count, config.eval_batches) if config.eval_batches else count


def make_eval_step(sums_fn: Callable[[PyTree, dict], dict]) -> Callable:
    """A pmapped ``(params, batch) -> sums`` whose sums are ``psum``-ed over every device.

    ``params`` may be replicated or sharded (fsdp.py).
    """

    def step(params: PyTree, batch: dict) -> dict:
        return jax.lax.psum(sums_fn(fsdp.gather_outer(params), batch), "data")

    return jax.pmap(step, axis_name="data")


def run_eval(
    eval_step: Callable, params: PyTree, batches: Iterator, count: int
) -> dict[str, float]:
    """Totals of ``eval_step`` over ``count`` batches (identical on every device and host)."""
    totals: dict[str, float] = {}
    for _ in range(count):
        sums = eval_step(params, parallel.shard_batch(next(batches)))
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + float(np.asarray(value)[0])
    return totals


@dataclasses.dataclass(slots=True)
class PreferenceTraining:
    """A trained model of a preference-data stage (sft, reward), ready to export."""

    model: Any  # the Transformer whose graph the params belong to
    manifest: dict[str, Any]
    config: TrainConfig  # as trained: lengths and learning rate resolved
    pretrained: bool  # whether the start held pretrained weights (model_io.is_pretrained)
    hf: dict[str, Any] | None  # the Hugging Face checkpoint it descends from (hf_source)
    result: FitResult
    final_eval: dict[str, float]
    shards_dir: str  # the shards it trained on: their tokenizer/ goes with the model

    def summary(self) -> dict[str, float]:
        """The last training metrics and the final evaluation, for the stage's caller."""
        return {**self.result.metrics, **{f"eval/{k}": v for k, v in self.final_eval.items()}}

    def save(self, output: str, stage: str, **extra: Any) -> None:
        """Export the trained model as ``stage``'s artifact (``extra`` joins its config.json)."""
        from components.core.model.artifact import save_model

        save_model(
            output, self.model, self.result.params, tokenizer=self.manifest["tokenizer"],
            stage=stage, training=dataclasses.asdict(self.config), step=self.result.step,
            pretrained=self.pretrained, tokenizer_dir=fileio.join(self.shards_dir, "tokenizer"),
            hf=self.hf, **extra,
        )  # fmt: skip


# What a stage may put between the preference stream and the step: a wrapper of each split's
# batches that keeps their position and restore (DPO adds the frozen reference's log-probs).
BatchWrapper = Callable[[StreamBatches], Iterator[dict[str, np.ndarray]]]


def train_on_preferences(
    config: TrainConfig,
    shards_dir: str,
    output: str,
    *,
    stage: str,
    base: str,
    scalar_head: bool,
    make_loss: Callable[[Any], parallel.LossFn],
    make_eval_sums: Callable[[Any], Callable],
    summarize_eval: Callable[[dict[str, float]], dict[str, float]],
    wrap_batches: Callable[[Any, PyTree], BatchWrapper] | None = None,
    inputs: dict[str, str] | None = None,
    train_split: str = "train",
) -> PreferenceTraining:
    """Build the stage's model, train it on ``train_split``, evaluate it on the eval split.

    ``wrap_batches(graphdef, initial_params)``, when given, returns the wrapper every split's
    batches pass through (train and eval alike). ``inputs``: the stage's model inputs as
    given (flag → folder) for :func:`fit`, which adds ``--shards``.
    """
    from flax import nnx

    from components.core.data.input_pipeline import longest_lengths, read_manifest, require_pairs
    from components.core.model.artifact import hf_source, is_pretrained, stage_model
    from components.core.training.distributed import maybe_initialize

    maybe_initialize()
    manifest = read_manifest(shards_dir)
    require_pairs(manifest, shards_dir, stage)
    if not config.max_len:
        config = dataclasses.replace(config, max_len=sum(longest_lengths(manifest)))
    pretrained = bool(base) and is_pretrained(base)
    config = config.resolved(pretrained=pretrained, adapting=bool(base))
    start = "pretrained start" if pretrained else "from scratch"
    log.info("%s: learning rate %g (%s)", stage, config.learning_rate, start)
    model = stage_model(
        manifest, base=base, preset=config.preset, scalar_head=scalar_head, seed=config.seed,
        remat=config.remat, dtype=config.dtype, adapters=config,
    )  # fmt: skip
    graphdef, params = nnx.split(model, nnx.Param)
    wrap = wrap_batches(graphdef, params) if wrap_batches else lambda batches: batches

    def batches(split: str, *, shuffle: bool, repeat: bool) -> Iterator[dict[str, np.ndarray]]:
        return wrap(preference_streams(shards_dir, split, config, shuffle=shuffle, repeat=repeat))

    eval_step = make_eval_step(make_eval_sums(graphdef))
    eval_count = eval_batch_count(manifest, "eval", config)

    def evaluate(placed_params: PyTree) -> dict[str, float]:
        eval_batches = batches("eval", shuffle=False, repeat=False)
        return summarize_eval(run_eval(eval_step, placed_params, eval_batches, eval_count))

    trainable, frozen = lora.split(params, model.config)
    if frozen is not None:
        log.info(
            "%s: LoRA rank %d, %d adapter parameters trained, the base frozen in %s",
            stage,
            config.lora_rank,
            lora.adapter_count(trainable),
            model.config.dtype,
        )
    result = fit(
        config=config, output=output, stage=stage, params=trainable, loss_fn=make_loss(graphdef),
        train_data=batches(train_split, shuffle=True, repeat=True), evaluate=evaluate,
        frozen=frozen,
        inputs={"--shards": shards_dir, **(inputs or {})},
    )  # fmt: skip
    final_eval = evaluate(parallel.place(result.params, sharded=config.fsdp))
    return PreferenceTraining(
        model, manifest, config, pretrained, hf_source(base), result, final_eval, shards_dir
    )
