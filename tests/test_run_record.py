"""Run records (run.json), ``alignpipe runs`` and configuration files (``--config``,
``alignpipe config dump``)."""

from __future__ import annotations

import datetime
import json
from importlib import metadata

import pytest
import yaml

from pipelines import run_record
from pipelines.cli.main import main
from pipelines.dag import config_file, param_table
from pipelines.targets.spec import read_spec


def test_a_config_file_nests_parameters_by_stage(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "seed: 3\nppo_epochs: 2\nppo:\n  rollout_batch_size: 32\n  kl_coef: 1\n"
        "evaluate:\n  max_new_tokens: 24\nsft:\n  steps: '7'\n"
    )
    values = config_file.read(str(path))
    assert values == {
        "seed": 3, "ppo_epochs": 2, "ppo_rollout_batch_size": 32, "kl_coef": 1.0,
        "eval_max_new_tokens": 24, "sft_steps": 7,
    }  # fmt: skip
    assert isinstance(values["kl_coef"], float)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ppo:\n  rolout_batch_size: 8\n", "unknown parameter ppo.rolout_batch_size; did you "
         "mean ppo.rollout_batch_size?"),
        ("sft:\n  seed: 1\n", "sft.seed is seed, which sits at the top level as seed"),
        ("learning_rate: 1e-5\n", "unknown parameter learning_rate; did you mean"),
        ("ppo:\n  iterations: many\n", "ppo_iterations: expected int, got 'many'"),
        ("- 1\n- 2\n", "expected a mapping of parameters"),
        ("ppo: 3\n", "ppo must hold a mapping of its parameters"),
    ],
)  # fmt: skip
def test_a_config_file_refuses_what_it_cannot_place(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(config_file.ConfigFileError, match=message.replace("?", r"\?")):
        config_file.read(str(path))


def test_config_dump_reads_back_as_every_default(tmp_path, capsys):
    out = tmp_path / "all.yaml"
    assert main(["config", "dump", "-o", str(out), "--sft-steps", "9"]) == 0
    values = config_file.read(str(out))
    defaults = {p.name: p.default_value() for p in param_table.PARAMS}
    assert values == {**defaults, "sft_steps": 9}
    assert "  # optimizer steps" in out.read_text()  # each with its help
    assert yaml.safe_load(out.read_text())["sft"]["steps"] == 9


def test_compile_takes_a_config_file_under_its_flags(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("ppo:\n  iterations: 7\n  ppo_epochs: 3\nseed: 5\n")
    spec = tmp_path / "p.yaml"
    argv = ["compile", "--target", "vertex", "-o", str(spec), "--config", str(config)]
    assert main([*argv, "--seed", "6"]) == 0
    compiled = read_spec(spec)[0]["root"]["inputDefinitions"]
    defaults = {k: v.get("defaultValue") for k, v in compiled["parameters"].items()}
    assert (defaults["ppo_iterations"], defaults["ppo_epochs"], defaults["seed"]) == (7, 3, 6)
    config.write_text("ppo:\n  iteration: 7\n")
    assert main(argv) == 2
    assert "did you mean ppo.iterations?" in capsys.readouterr().err


def test_a_record_holds_every_parameter_its_source_and_its_inputs(tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    gold = tmp_path / "gold.py"
    gold.write_text("def score(prompt, response):\n    return 0.0\n")
    values = {"data_uri": str(data), "gold_reward": f"{gold}:score", "seed": 4}
    started = datetime.datetime(2026, 12, 5, 1, 0, tzinfo=datetime.UTC)
    record = run_record.record(
        values, {"data_uri": "config", "seed": "flag"}, started=started,
        ended=started + datetime.timedelta(seconds=90), outcome="succeeded",
        stages={"ppo": {"status": "ran", "seconds": 12.5}},
    )  # fmt: skip
    assert set(record["parameters"]) == {p.name for p in param_table.PARAMS}
    assert record["parameters"]["seed"] == {"value": 4, "source": "flag"}
    assert record["parameters"]["data_uri"]["source"] == "config"
    assert record["parameters"]["kl_coef"]["source"] == "default"
    digest = record["inputs"]["data_uri"][str(data)]
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert list(record["inputs"]["gold_reward"]) == [str(gold)]
    assert record["seconds"] == 90.0 and record["libraries"]["jax"]
    assert run_record.values_of(record) == values  # what it was given, no defaults
    # alignpipe runs lists it; runs show prints it with each parameter's source.
    folder = tmp_path / "runs" / "alignpipe-2026-12-05-01-00-00-000000"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(record))
    assert main(["runs", "--runs-dir", str(tmp_path / "runs")]) == 0
    listing = capsys.readouterr().out
    assert folder.name in listing and "succeeded" in listing and "seed=4" in listing
    assert main(["runs", "show", folder.name, "--runs-dir", str(tmp_path / "runs")]) == 0
    shown = capsys.readouterr().out
    assert "  seed = 4  (flag)" in shown and "ppo ran 12.5 s" in shown
    assert main(["runs", "show", "nope", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "alignpipe runs` lists them" in capsys.readouterr().err


def test_cloud_labels_name_the_code():
    labels = run_record.cloud_labels()
    assert labels["alignpipe_version"]
    assert labels["jax_version"] == metadata.version("jax").replace(".", "-")
    assert labels["kfp_version"] and labels["apache_version"]  # apache-beam
    assert all(len(v) <= 63 and v == v.lower() for v in labels.values())


def test_a_compiled_spec_carries_the_record_of_its_runs(tmp_path):
    """The parameters with their sources, the code and the libraries travel in the spec's
    pipelineInfo description (Vertex and Kubeflow keep it with each run)."""
    config = tmp_path / "run.yaml"
    config.write_text("ppo:\n  iterations: 7\n")
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    spec = tmp_path / "p.yaml"
    argv = ["compile", "--target", "vertex", "-o", str(spec), "--config", str(config)]
    assert main([*argv, "--seed", "6", "--data-uri", str(data)]) == 0
    compiled = read_spec(spec)[0]
    record = run_record.read_spec_record(compiled)
    assert record["parameters"]["seed"] == {"value": 6, "source": "flag"}
    assert record["parameters"]["ppo_iterations"] == {"value": 7, "source": "config"}
    assert record["parameters"]["kl_coef"]["source"] == "default"
    assert record["code"]["alignpipe"] and record["libraries"]["kfp"]
    assert list(record["inputs"]["data_uri"]) == [str(data)]
    assert compiled["pipelineInfo"]["name"] == "alignpipe"  # the rest of the spec as it was


ORBAX_SAVE = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="[task %(levelname)s]: %(message)s")
from components.core.entry import start_process
start_process()
import numpy as np, orbax.checkpoint as ocp
manager = ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(max_to_keep=1))
manager.save(1, args=ocp.args.StandardSave({"a": np.ones(3)}))
manager.wait_until_finished()
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_orbax_info_lines_stay_out_of_a_task_log_unless_verbose(tmp_path, verbose):
    """A task's log (kfp's executor logs at INFO) gets Orbax's per-checkpoint lines only
    with ``alignpipe run --verbose`` (ALIGNPIPE_VERBOSE)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ALIGNPIPE_VERBOSE"}
    if verbose:
        env["ALIGNPIPE_VERBOSE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", ORBAX_SAVE, str(tmp_path / "checkpoints")],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    saved = "Finished saving checkpoint" in done.stderr
    assert saved is verbose


def test_one_spelling_per_concept_and_old_ones_refused_with_the_new(capsys):
    """A reward model folder is --reward-model in every command (run's --eval-reward-model
    is evaluate's); a bool flag alone means true in the pipeline's flags as in the stages'."""
    from components.evaluate.__main__ import main as evaluate_main
    from components.ppo.__main__ import main as ppo_main

    for entry in (evaluate_main, ppo_main):
        with pytest.raises(SystemExit) as exit_:
            entry(["--reward", "rm"])
        assert exit_.value.code == 2
        assert "--reward is now --reward-model" in capsys.readouterr().err
    assert main(["config", "dump", "--fsdp", "--adaptive-kl", "false"]) == 0
    dumped = yaml.safe_load(capsys.readouterr().out)
    assert dumped["fsdp"] is True and dumped["ppo"]["adaptive_kl"] is False


def test_the_readmes_config_file_is_one(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "run.yaml"
    path.write_text(block)
    values = config_file.read(str(path))
    assert values["algorithm"] == "grpo" and values["ppo_rollout_batch_size"] == 128


@pytest.mark.parametrize(
    ("words", "expected", "absent"),
    [
        ("alignpipe ru", {"run", "runs"}, {"rerun"}),
        ("alignpipe run --ppo-roll", {"--ppo-rollout-batch-size"}, set()),
        ("alignpipe runs s", {"show"}, set()),
        ("alignpipe data validate --max-p", {"--max-prompt-tokens"}, set()),
        ("alignpipe plan --run-preset v5e-8-1b --comp", {"--compile"}, set()),
    ],
)
def test_bash_completion_completes_commands_and_their_flags(
    tmp_path, capsys, words, expected, absent
):
    import shutil
    import subprocess

    if not shutil.which("bash"):
        pytest.skip("no bash here")
    assert main(["completion", "bash"]) == 0
    script = tmp_path / "complete.sh"
    script.write_text(capsys.readouterr().out)
    parts = words.split()
    probe = (
        f"source {script}; COMP_WORDS=({words}); COMP_CWORD={len(parts) - 1}; _alignpipe; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True)
    found = set(done.stdout.split())
    assert expected <= found and not (absent & found), found
