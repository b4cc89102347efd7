"""MetricsLogger: JSON lines, TensorBoard events, quiet progress off a terminal, summary."""

from __future__ import annotations

import io

import numpy as np

from components.core.training.metrics import MetricsLogger, read_metrics


def test_jsonl_tensorboard_progress_and_summary(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(
        str(tmp_path), total_steps=30, stage="reward", print_every=10, stream=stream
    ) as logger:
        for step in range(1, 31):
            logger.log(step, {"loss": np.float32(1.0 / step), "acc": np.array([0.5, 1.0])})
        summary = logger.summary()
    records = read_metrics(str(tmp_path))
    assert len(records) == 30
    assert records[0]["step"] == 1 and records[0]["loss"] == 1.0 and records[0]["acc"] == 0.75
    assert {"time", "stage"} <= set(records[0])
    assert (
        summary == {"loss": 1.0 / 30, "acc": 0.75, "step": 30.0}
        or abs(summary["loss"] - 1.0 / 30) < 1e-6
    )
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # every 10th call, not every call, when not a terminal
    assert "step 30/30" in lines[-1] and "steps/s" in lines[-1] and "eta" in lines[-1]
    events = [str(p) for p in (tmp_path / "tensorboard").iterdir()]
    assert len(events) == 1 and "events.out.tfevents" in events[0]
    # Written without TensorFlow, read with its parser: what TensorBoard reads.
    import tensorflow as tf

    steps = [tf.compat.v1.Event.FromString(r.numpy()) for r in tf.data.TFRecordDataset(events)]
    assert steps[0].file_version == "brain.Event:2"
    scalars = {
        (e.step, v.tag): (tf.make_ndarray(v.tensor), v.metadata.plugin_data.plugin_name)
        for e in steps
        for v in e.summary.value
    }
    assert len(scalars) == 60 and scalars[(30, "train/acc")] == (0.75, "scalars")
    value, _ = scalars[(30, "train/loss")]
    assert value.shape == () and value.dtype == np.float32 and value == np.float32(1 / 30)
    assert all(e.wall_time > 1.7e9 for e in steps)


def test_resumed_logger_appends(tmp_path):
    for start in (1, 3):
        with MetricsLogger(
            str(tmp_path), total_steps=4, stage="sft", tensorboard=False, stream=io.StringIO()
        ) as logger:
            logger.log(start, {"loss": 1.0})
            logger.log(start + 1, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]


def test_resume_drops_records_logged_after_the_checkpoint(tmp_path):
    quiet = dict(total_steps=6, stage="sft", tensorboard=False, stream=io.StringIO())
    with MetricsLogger(str(tmp_path), resume_step=0, **quiet) as logger:
        for step in range(1, 6):  # killed after step 5; its last checkpoint is step 3
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(str(tmp_path), resume_step=3, **quiet) as logger:
        for step in range(4, 7):
            logger.log(step, {"loss": 10.0 * step})
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]
