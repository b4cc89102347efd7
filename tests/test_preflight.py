"""A local run's inputs are refused before any task runs, naming the flag; failed tasks' errors
are read back from the run's log."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from components.core.data.builtin_task import write_jsonl
from pipelines.cli.main import main
from pipelines.dag import params, preflight
from pipelines.releases import policies
from pipelines.targets.local import run_log
from pipelines.targets.local.run import run_local

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def _policy(folder: Path) -> Path:
    """A folder shaped like a policy artifact (what the checks look at: config.json, params/)."""
    (folder / "params").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def _refused(values: dict, runs: Path) -> str:
    """run_local's refusal of ``values``: fast, with no task started; returns the message."""
    started = time.monotonic()
    with pytest.raises(preflight.PreflightError) as refusal:
        run_local(values, runs_dir=runs, echo=False)
    # No task started (each takes longer); loose, for 2 busy cores.
    assert time.monotonic() - started < 10.0
    assert not any(runs.glob("alignpipe-*")) and not any(runs.glob("running-*"))
    assert not (runs / "last_run.json").exists()  # a refused run is no run to repeat
    return str(refusal.value)


def test_bad_local_inputs_are_refused_before_any_task_naming_the_flag(tmp_path):
    runs = tmp_path / "runs"
    message = _refused({"base_policy": "/nonexistent"}, runs)
    assert message.startswith("--base-policy: '/nonexistent' does not exist")
    assert "or '' to train one with sft" in message
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in _refused({"base_policy": str(empty)}, runs)

    message = _refused({"data_uri": f"{tmp_path}/data/*.jsonl"}, runs)
    assert message.startswith("--data-uri: ") and "matches no file" in message
    message = _refused({"data_uri": str(empty)}, runs)
    assert f"'{empty}' holds no data file (.jsonl, .json, .parquet" in message

    message = _refused({"tokenizer": str(tmp_path / "tokenizer.json")}, runs)
    assert message.startswith("--tokenizer: ") and "no such file or folder" in message


def test_a_device_count_below_one_or_not_a_number_is_refused_naming_where_it_came_from(
    tmp_path, monkeypatch
):
    runs = tmp_path / "runs"
    with pytest.raises(params.ParamError, match="^--cpu-devices: 0 must be at least 1$"):
        run_local({}, runs_dir=runs, cpu_devices=0, echo=False)
    for raw in ("eight", "0", "-2", "", "²"):
        monkeypatch.setenv("ALIGNPIPE_CPU_DEVICES", raw)
        with pytest.raises(params.ParamError, match=f"^ALIGNPIPE_CPU_DEVICES='{raw}': .* whole"):
            run_local({}, runs_dir=runs, echo=False)
    assert not runs.exists()


def test_other_local_paths_are_checked_only_where_the_run_reads_them(tmp_path):
    runs = tmp_path / "runs"
    missing = str(tmp_path / "missing")
    assert _refused({"anchor_policy": missing}, runs).startswith("--anchor-policy: ")
    assert _refused({"reward_base_policy": missing}, runs).startswith("--reward-base-policy: ")
    dpo = {"algorithm": "dpo", "eval_reward_model": missing}
    assert "the reward stage's model folder" in _refused(dpo, runs)
    (tmp_path / "file").write_text("x")
    message = _refused({"promoted_policy_uri": str(tmp_path / "file")}, runs)
    assert message.startswith("--promoted-policy-uri: ") and "is a file" in message
    assert "No closing quotation" in _refused({"beam_args": "--runner='x"}, runs)
    # dpo trains no reward model: its base is not read, so not checked.
    preflight.check(params.validate({"algorithm": "dpo", "reward_base_policy": missing}, 8))
    # gs:// is the tasks' to read (credentials, network): not checked here.
    preflight.check(params.validate({"base_policy": "gs://bucket/policy"}, 8))


def test_a_model_of_the_wrong_kind_a_file_as_runs_dir_and_a_negative_seed(tmp_path):
    policy = _policy(tmp_path / "policy")
    reward = _policy(tmp_path / "reward")
    info = json.loads((reward / "config.json").read_text())
    (reward / "config.json").write_text(json.dumps({**info, "scalar_head": True}))
    runs = tmp_path / "runs"
    message = _refused({"base_policy": str(reward)}, runs)
    assert message.startswith("--base-policy: base_policy") and "is a reward model" in message
    judge = {"algorithm": "dpo", "eval_reward_model": str(policy)}
    assert "is a policy (stage None, no scalar head), not a reward model" in _refused(judge, runs)
    with pytest.raises(params.ParamError, match="^sft parameters: seed: -1 must be >= 0$"):
        run_local({"seed": -1}, runs_dir=runs, echo=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(params.ParamError, match="^--runs-dir .*file is a file; pass a folder"):
        run_local({}, runs_dir=tmp_path / "file", echo=False)


def _llama_fingerprint() -> str:
    """The fingerprint of the llama fixture's tokenizer as its model uses it."""
    from components.core.data.tokenizers import load_tokenizer

    return load_tokenizer(str(FIXTURES / "llama")).fingerprint


def _trained_on(folder: Path, fingerprint: str) -> Path:
    """``folder``'s config.json records the tokenizer it was trained with."""
    info = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**info, "tokenizer": {"fingerprint": fingerprint}})
    )
    return folder


def test_good_local_inputs_pass(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    policy = _trained_on(_policy(tmp_path / "policy"), _llama_fingerprint())
    values = {
        "data_uri": f"{tmp_path}/*.jsonl",
        "tokenizer": str(FIXTURES / "llama"),  # the model's own, fitted to its embedding
        "base_policy": str(policy),
        "reward_base_policy": str(FIXTURES / "llama"),  # a Hugging Face folder
        "anchor_policy": str(policy),
        "promoted_policy_uri": str(tmp_path / "promoted"),  # made on the first promotion
        "beam_args": "--runner=DirectRunner",
        "gold_reward": "builtin/sentiment-v1",
    }
    preflight.check(params.validate(values, 8))
    # A promotion root stands for its current version (a scheduled run's warm start).
    root = tmp_path / "promoted"
    assert policies.promote(str(policy), str(tmp_path / "artifact"), str(root)) == 1
    warm = {**values, "base_policy": str(root), "anchor_policy": str(root)}
    preflight.check(params.validate(warm, 8))


def test_the_cli_prints_the_refusal_and_starts_nothing(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert main(["run", "--runs-dir", str(runs), "--base-policy", "/nonexistent"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: --base-policy: '/nonexistent' does not exist")
    assert captured.out == "" and not any(runs.glob("alignpipe-*"))


# kfp.local's output around a failed task, as a run's log holds it (colour codes removed).
FAILED_LOG = """\
16:24:44.594 - INFO - Executing task 'shard'
    [KFP Executor 2026-11-30 16:24:44,643 INFO]: Got executor_input:
    {"inputs": {}}
    Traceback (most recent call last):
      File "/work/main/pipelines/stage_io.py", line 77, in failure_reason
        yield
    KeyError: 'x'

    During handling of the above exception, another exception occurred:

    Traceback (most recent call last):
      File "<frozen runpy>", line 198, in _run_module_as_main
        output_file = executor.execute()
                      ^^^^^^^^^^^^^^^^^^
    components.shard.stage.ShardError: 40 of 50 input records (80.0%) were rejected
    by reason: missing_field: 40


16:24:44.658 - ERROR - Task 'shard' finished with status FAILURE
16:25:00.000 - INFO - Executing task 'ppo'
    [KFP Executor 2026-11-30 16:25:00,000 INFO]: step 3
    Killed

16:25:09.000 - ERROR - Task 'ppo' finished with status FAILURE
"""


def test_a_failed_tasks_exception_is_read_from_the_log():
    errors = run_log.task_errors(FAILED_LOG)
    assert errors == {
        "shard": "components.shard.stage.ShardError: 40 of 50 input records (80.0%) were "
        "rejected\nby reason: missing_field: 40",
        "ppo": "the task ended without a traceback; its last output: Killed",
    }
    coloured = FAILED_LOG.replace("'shard'", "\x1b[96m'shard'\x1b[0m")
    assert run_log.task_errors(coloured)["shard"] == errors["shard"]


def test_the_log_capture_takes_prints_logging_and_stderr(tmp_path, capsys):
    import logging
    import sys

    log = tmp_path / "run.log"
    with run_log.capture(log):
        print("\x1b[96mexecutor line\x1b[0m")
        logging.getLogger().warning("root record")
        sys.stderr.write("stderr line\n")
    text = log.read_text()
    assert "executor line" in text and "\x1b[" not in text
    assert "root record" in text and "stderr line" in text
    assert capsys.readouterr() == ("", "")


def test_a_glob_the_shell_expanded_gets_a_hint(capsys):
    from pipelines.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "--data-uri", "data/a.jsonl", "data/b.jsonl"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "unrecognized arguments: data/b.jsonl; quote globs" in error


def test_models_on_other_tokenizers_are_refused_naming_both_sides(tmp_path):
    """Every model of a run must read the shards' token ids; the shards take the base policy's
    tokenizer unless --tokenizer says otherwise."""
    (tmp_path / "a.jsonl").write_text("{}\n")
    data = {"data_uri": f"{tmp_path}/*.jsonl"}
    llama, qwen = str(FIXTURES / "llama"), str(FIXTURES / "qwen2")
    runs = tmp_path / "runs"
    # A Hugging Face base brings its tokenizer: a reward base of another family is refused.
    message = _refused({**data, "base_policy": llama, "reward_base_policy": qwen}, runs)
    assert message.startswith(f"--reward-base-policy: '{qwen}' uses tokenizer ")
    assert (
        "(--base-policy's own)" in message and "--tokenizer with --reward-base-policy's" in message
    )
    # Without a base policy, files shard with bytes: a Hugging Face reward base needs
    # --tokenizer (its own), which the check then accepts.
    message = _refused({**data, "reward_base_policy": qwen}, runs)
    assert "(the data's default)" in message
    preflight.check(params.validate({**data, "reward_base_policy": qwen, "tokenizer": qwen}, 8))
    # A tokenizer given against the base policy: refused, naming --tokenizer as the source.
    gemma = str(FIXTURES / "gemma2")
    message = _refused({**data, "base_policy": llama, "tokenizer": gemma}, runs)
    assert message.startswith(f"--base-policy: '{llama}' uses tokenizer ")
    assert f"(--tokenizer {gemma})" in message
    # Data files without a base model shard with bytes: a model trained otherwise is refused.
    policy = _trained_on(_policy(tmp_path / "policy"), _llama_fingerprint())
    message = _refused({**data, "anchor_policy": str(policy)}, runs)
    assert message.startswith("--anchor-policy: ") and "(the data's default)" in message
    # The base's own tokenizer, by default or named, passes with models that share it.
    same = {**data, "base_policy": llama, "reward_base_policy": llama, "anchor_policy": str(policy)}
    preflight.check(params.validate(same, 8))
    preflight.check(params.validate({**same, "tokenizer": llama}, 8))


def test_a_hugging_face_base_policy_is_checked_as_its_import_would(tmp_path):
    """Architecture, tensors and tokenizer against the embedding, before any task runs."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in (FIXTURES / "qwen2").iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    message = _refused({"base_policy": str(broken)}, tmp_path / "runs")
    assert message.startswith("--base-policy: the checkpoint does not match its config.json")
    assert "model.embed_tokens.weight: checkpoint [320, 32], config expects [320, 48]" in message
    (broken / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]})
    )
    message = _refused({"base_policy": str(broken)}, tmp_path / "runs")
    assert message.startswith("--base-policy: ") and "GPT2LMHeadModel" in message


def test_a_chat_template_that_refuses_the_data_stops_the_run_with_its_message(tmp_path):
    """The README walkthrough's conversational data (a system turn) with Gemma 2, whose
    template has no system role: refused before the Beam job with the template's message
    and the fix, not 3,000 records in rejected/; folded into the first user turn, it runs."""
    from components.core.data.builtin_task import write_jsonl

    data = tmp_path / "pairs.jsonl"
    write_jsonl(str(data), 8, seed=0, conversational=True, system="You are kind.")
    values = {"data_uri": str(data), "base_policy": str(FIXTURES / "gemma2")}
    message = _refused(values, tmp_path / "runs")
    assert message.startswith(f"--data-uri: {data} line 1: the chat template of")
    assert "System role not supported" in message and "--system-message fold" in message
    for mode in ("fold", "drop"):
        preflight.check(params.validate({**values, "system_message": mode}, 8))
    # The held-out model's data is rendered as well: a system turn there alone is refused,
    # naming its own parameter.
    plain, other = tmp_path / "plain.jsonl", tmp_path / "other.jsonl"
    write_jsonl(str(plain), 8, seed=0, conversational=True)
    write_jsonl(str(other), 8, seed=1, conversational=True, system="You are kind.")
    given = {**values, "data_uri": str(plain)}
    preflight.check(params.validate(given, 8))
    message = _refused({**given, "heldout_data_uri": str(other)}, tmp_path / "runs2")
    assert message.startswith(f"--heldout-data-uri: {other} line 1: the chat template of")
    assert "System role not supported" in message and "--system-message fold" in message
    preflight.check(params.validate({**given, "heldout_data_uri": str(other),
                                     "system_message": "fold"}, 8))  # fmt: skip
    # Qwen3's template takes a system turn, and its arguments come along.
    qwen3 = {**values, "base_policy": str(FIXTURES / "qwen3")}
    preflight.check(
        params.validate({**qwen3, "chat_template_kwargs": '{"enable_thinking": false}'}, 8)
    )


def test_a_tracker_not_installed_or_misspelled_is_refused_naming_report_to(tmp_path, monkeypatch):
    from components.core.training import trackers

    runs = tmp_path / "runs"
    with pytest.raises(params.ParamError, match="sft parameters: report_to: unknown tracker 'wan"):
        run_local({"report_to": "tensorboard,wandbb"}, runs_dir=runs, echo=False)
    monkeypatch.setattr(trackers, "installed", lambda name: name != "mlflow")
    message = _refused({"report_to": "mlflow"}, runs)
    assert message == (
        "--report-to: mlflow not installed here (mlflow: pip install 'alignpipe[mlflow]')"
    )


def test_prompt_only_data_is_refused_before_any_task_naming_the_fix(tmp_path):
    """TRL's prompt-only records in a pipeline run: nothing to train its reward model (or
    DPO's policy) on, and without a base policy nothing to start from: refused, naming the
    base policy when it is missing and the stage to run by hand on such data."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": i + 1}) + "\n"
                            for i in range(8)))  # fmt: skip
    message = _refused({"data_uri": str(data)}, tmp_path / "runs")
    assert message.startswith(f"--data-uri: {data} line 1 is a prompt-only record (prompt)")
    assert "--train-reward-model false and --reward-functions" in message
    assert "--base-policy" in message and "--sft-data-uri" in message
    given = {"data_uri": str(data), "base_policy": str(FIXTURES / "qwen3")}
    message = _refused(given, tmp_path / "runs2")
    assert "--base-policy" not in message and "preference pairs" in message
    scored = {**given, "base_policy": "", "train_reward_model": False, "algorithm": "grpo",
              "reward_functions": "builtin/exact-match"}  # fmt: skip
    message = _refused(scored, tmp_path / "runs3")
    assert "--reward-functions" not in message and "--sft-data-uri" in message
    assert "--max-new-tokens and --eval-max-new-tokens (0 takes the longest" in message


def test_heldout_data_that_is_missing_or_not_pairs_is_refused_naming_it(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(str(pairs), 40)
    given = {"data_uri": str(pairs), "heldout_data_uri": f"{tmp_path}/other/*.jsonl"}
    message = _refused(given, tmp_path / "runs")
    assert message.startswith("--heldout-data-uri: ") and "matches no file" in message
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + 1 ="}) + "\n" for i in range(8)))
    message = _refused({**given, "heldout_data_uri": str(prompts)}, tmp_path / "runs2")
    assert message.startswith(f"--heldout-data-uri: {prompts} line 1 is a prompt-only record")
    assert "trains on preference pairs" in message


def test_sft_data_of_prompts_alone_is_refused_and_reads_its_own_columns(tmp_path):
    """openai/gsm8k's rows as the RL prompts (data_columns) and as sft's worked solutions
    (sft_data_columns); renamed by the run's data_columns alone, the sft data is prompts."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1 =", "answer": f"#### {i + 1}"})
                            + "\n" for i in range(8)))  # fmt: skip
    given = {"data_uri": str(data), "sft_data_uri": str(data),
             "data_columns": '{"question": "prompt"}', "train_reward_model": False,
             "algorithm": "grpo", "reward_functions": "builtin/exact-match",
             "max_new_tokens": 16, "eval_max_new_tokens": 16}  # fmt: skip
    message = _refused(given, tmp_path / "runs")
    assert message.startswith(f"--sft-data-uri: {data} line 1 is a prompt-only record (prompt)")
    assert "--sft-data-columns" in message
    own = {**given, "sft_data_columns": '{"question": "prompt", "answer": "completion"}'}
    preflight.check(params.validate(own, 8))
