"""Experiment trackers (report_to) against their real local backends: TensorBoard's own event
reader, an MLflow file store, W&B offline mode (its run file read back record by record), and
Vertex AI Experiments against the SDK's own function signatures (nothing reaches Google
Cloud)."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from unittest import mock

import pytest

from components.core.training import trackers
from components.core.training.metrics import MetricsLogger
from components.evaluate.config import EvalConfig
from components.evaluate.outputs import report_figures
from components.sft import SFTConfig

RUN_OUTPUT = "runs/alignpipe-20261205/sft/model"  # kfp.local's <root>/<run>/<task>/<artifact>


def _log_steps(out: str, config, steps=range(1, 4), resume_step=None) -> None:
    quiet = dict(stream=io.StringIO(), resume_step=resume_step)
    with MetricsLogger(out, total_steps=3, stage="sft", config=config, **quiet) as logger:
        for step in steps:
            logger.log(step, {"loss": 1.0 / step, "eval/loss": 2.0 / step})


def test_report_to_names_trackers_as_trl_does():
    assert trackers.parse_report_to("tensorboard") == ("tensorboard",)
    assert trackers.parse_report_to(" WandB, mlflow,wandb ") == ("wandb", "mlflow")
    assert trackers.parse_report_to("none") == trackers.parse_report_to("") == ()
    assert "tensorboard" in trackers.parse_report_to("all")
    with pytest.raises(ValueError, match="report_to: unknown tracker 'tensorbord'"):
        SFTConfig(report_to="tensorbord")
    with pytest.raises(ValueError, match="tracker_project"):
        EvalConfig(tracker_project=" ")
    # The Hugging Face trainers' names: train/ on training figures, eval/ kept.
    assert trackers.tracked_name("objective/kl") == "train/objective/kl"
    assert trackers.tracked_name("eval/accuracy") == "eval/accuracy"
    assert trackers.run_id_of(RUN_OUTPUT) == "alignpipe-20261205"
    assert trackers.vertex_name("Alignpipe_Run.7-SFT") == "alignpipe-run-7-sft"


def test_tensorboards_own_reader_reads_the_scalars(tmp_path):
    """TensorBoard's event accumulator (what its scalars dashboard loads) reads our event
    files: the Hugging Face trainers' tags, the scalars plugin, every step."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    _log_steps(str(tmp_path), SFTConfig())  # report_to's default: tensorboard
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["tensors"]) == ["eval/loss", "train/loss"]
    for tag, scale in (("train/loss", 1.0), ("eval/loss", 2.0)):
        assert accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
        points = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in
                  accumulator.Tensors(tag)]  # fmt: skip
        assert points == [(s, pytest.approx(scale / s)) for s in (1, 2, 3)]


def test_a_missing_tracker_package_names_its_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(trackers, "installed", lambda name: name == "tensorboard")
    with pytest.raises(ValueError, match=r"wandb not installed here.*alignpipe\[wandb\]"):
        _log_steps(str(tmp_path), SFTConfig(report_to="tensorboard,wandb"))
    assert trackers.parse_report_to("all") == ("tensorboard",)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local MLflow file store (MLflow 3 asks for the opt-in to file stores)."""
    mlflow = pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)
    yield mlflow.tracking.MlflowClient(uri)
    mlflow.set_tracking_uri(None)


def test_mlflow_run_per_stage_resumed_in_place(mlflow_store, tmp_path):
    out = str(tmp_path / RUN_OUTPUT)
    config = SFTConfig(report_to="tensorboard,mlflow", tracker_project="exp", learning_rate=3e-3)
    _log_steps(out, config, steps=(1, 2))
    _log_steps(out, config, steps=(2, 3), resume_step=1)  # a resumed task: the same run
    experiment = mlflow_store.get_experiment_by_name("exp")
    (run,) = mlflow_store.search_runs([experiment.experiment_id])
    assert run.info.run_name == "alignpipe-20261205-sft"
    assert run.data.tags["alignpipe.stage"] == "sft"
    assert run.data.params["learning_rate"] == "0.003" and run.data.params["report_to"]
    history = mlflow_store.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.5), (2, 0.5), (3, 1 / 3)]
    assert run.data.metrics["eval/loss"] == pytest.approx(2 / 3)
    assert os.listdir(os.path.join(out, "tensorboard"))  # TensorBoard beside it


def _wandb_records(folder: Path) -> list:
    """The protobuf records of a W&B offline run file: a 7-byte header (":W&B", magic,
    version), then LevelDB-log framing: 32 KiB blocks of (crc32, length, type) chunks."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a split one's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = SFTConfig(report_to="wandb", tracker_project="proj", steps=3)
    out = str(tmp_path / RUN_OUTPUT)
    _log_steps(out, config)
    assert not os.path.exists(os.path.join(out, "tensorboard"))  # not asked for
    records = _wandb_records(tmp_path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.run_group, run.project, run.job_type) == (
        "alignpipe-20261205-sft", "alignpipe-20261205", "proj", "sft",
    )  # fmt: skip
    config_items = {i.key: i.value_json for i in run.config.update}
    assert config_items["steps"] == "3" and config_items["report_to"] == '"wandb"'
    history = [
        (
            r.history.step.num,
            {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item},
        )
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(step, float(h["train/loss"])) for step, h in history] == [
        (1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)),
    ]  # fmt: skip
    assert float(history[-1][1]["eval/loss"]) == pytest.approx(2 / 3)


def test_vertex_experiments_calls_match_the_sdk(tmp_path, monkeypatch):
    aiplatform = pytest.importorskip("google.cloud.aiplatform")
    calls = mock.Mock()
    for name in ("init", "start_run", "log_params", "log_time_series_metrics", "end_run"):
        # autospec: each call is bound to the SDK's real signature, or it raises TypeError.
        monkeypatch.setattr(aiplatform, name, mock.create_autospec(getattr(aiplatform, name)))
        calls.attach_mock(getattr(aiplatform, name), name)
    config = EvalConfig(
        report_to="vertex", tracker_project="Align_Exp",
        vertex_tensorboard="projects/p/locations/us-central1/tensorboards/7",
    )  # fmt: skip
    out = str(tmp_path / "runs/alignpipe-20261205/evaluate/evaluation")
    report_figures(out, {"win_rate": 0.75, "best_of_n.n4.gold": 0.5, "blessed": 1.0}, config)
    names = [c[0] for c in calls.mock_calls]
    assert names == ["init", "start_run", "log_params", "log_time_series_metrics", "end_run"]
    init, start, params, series, _ = calls.mock_calls
    assert init.kwargs == {
        "experiment": "align-exp",
        "experiment_tensorboard": "projects/p/locations/us-central1/tensorboards/7",
    }
    assert start.args == ("alignpipe-20261205-evaluate",) and start.kwargs == {"resume": False}
    assert all(isinstance(v, str | int | float) for v in params.args[0].values())
    assert params.args[0]["greedy"] == "False"  # booleans as text: Vertex takes str/int/float
    assert series.args[0] == {
        "eval/win_rate": 0.75, "eval/best_of_n/n4/gold": 0.5, "eval/blessed": 1.0,
    }  # fmt: skip
    assert series.kwargs == {"step": 1}
