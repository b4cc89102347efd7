"""The ppo and evaluate stages as real processes: 2 hosts x 4 CPU devices vs 1 host x 8.

Both with ``--fsdp true``: every model's parameters (and PPO's optimizer states) in
chunks over all 8 devices, split across the two processes. The inputs are made
without training (freshly initialised ``tiny`` models saved as artifacts): this
checks the multi-host plumbing (data split, collectives, gathers, checkpoints and
resuming from them, who writes what), not what PPO learns.

What may differ between the two layouts: float32 reductions over devices (the
gradient ``pmean``, the chunks' reduce-scatter) run as one in-process all-reduce
on 1 host and over gloo across 2, summing in another order, so values agree to a
few ulps per step (measured: parameters within 1.2e-7 after 3 iterations that move
them by ~6e-3, but for single weights with ~0 gradients, where Adam's normalization
makes it ~1e-6; metrics within ~1e-7 relative). Sampled tokens are discrete and
must agree exactly; so must everything counted from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx
from test_multihost import _free_ports, clean_env

from components.core.data.builtin_task import write_jsonl
from components.core.data.input_pipeline import read_manifest
from components.core.model.artifact import create_model, load_model, save_model
from components.core.training import distributed
from components.core.training.checkpoint import work_checkpoint_dir
from components.core.training.metrics import read_metrics
from components.shard import ShardConfig
from components.shard import run as run_shard

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT_S = 240  # per process; a hang (a collective one process never joins) fails, not blocks
ITERATIONS = 3
# Two prompt streams: each host of two reads one, one host reads both, so the rollout
# batches are the same. A learning rate that moves the parameters visibly in 3 iterations.
PPO_FLAGS = [
    "--rollout-batch-size", "16", "--minibatches", "2",
    "--ppo-epochs", "1", "--max-new-tokens", "8", "--save-every", "1", "--data-streams", "2",
    "--learning-rate", "1e-3", "--critic-learning-rate", "1e-3", "--warmup-steps", "0",
    "--fsdp", "true",
]  # fmt: skip
EVAL_FLAGS = ["--max-new-tokens", "8", "--bootstrap-samples", "200", "--fsdp", "true"]
# Few samples and a short best-of-n: the two layouts agree or not whatever their number.
EVAL_FLAGS += ["--samples-per-prompt", "2", "--best-of-n", "1,2"]
# Float figures: a few ulps of float32 sums apart (see the module docstring).
CLOSE = dict(rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Shards of the built-in task, an untrained policy and an untrained reward model."""
    root = tmp_path_factory.mktemp("ppo_multihost")
    write_jsonl(str(root / "pairs.jsonl"), 600, seed=4)
    paths = {name: str(root / name) for name in ("shards", "policy", "reward")}
    run_shard(
        ShardConfig(num_shards=4, tokenizer="builtin-words"),
        [str(root / "pairs.jsonl")],
        paths["shards"],
    )
    manifest = read_manifest(paths["shards"])
    vocab = int(manifest["tokenizer"]["vocab_size"])
    for role, head, seed in [("policy", False, 0), ("reward", True, 1)]:
        model = create_model("tiny", vocab, scalar_head=head, seed=seed)
        save_model(
            paths[role], model, nnx.state(model, nnx.Param), tokenizer=manifest["tokenizer"],
            stage="reward" if head else "sft", training={}, step=0,
        )  # fmt: skip
    with open(os.path.join(paths["reward"], "reward_stats.json"), "w") as handle:
        json.dump({"mean": 0.0, "std": 1.0}, handle)
    paths["root"] = str(root)
    return paths


def _launch(module: str, args: list[str], hosts: int, port: int) -> list[subprocess.Popen]:
    """``python -m module`` as 1 process of 8 CPU devices, or 2 of 4 joined at ``port``."""
    clean = clean_env()
    # -X importtime's lines on stderr: the tests see which modules a stage imported.
    clean.update(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu", PYTHONPROFILEIMPORTTIME="1")
    processes = []
    for index in range(hosts):
        env = dict(clean, ALIGNPIPE_CPU_DEVICES=str(8 // hosts))
        if hosts > 1:
            # No persistent compilation cache: JAX writes it from process 0 only, so on resume
            # both processes ran process 0's executable deserialized, and with the optimizer
            # step's in-place selects (optim.adamw_step) that hung in the PPO update's
            # collectives (XLA:CPU, jaxlib 0.10.2); compiled fresh in each process it passes.
            # The stages set no persistent cache.
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            env[distributed.ENV_COORDINATOR] = f"127.0.0.1:{port}"
            env[distributed.ENV_NUM_PROCESSES] = str(hosts)
            env[distributed.ENV_PROCESS_ID] = str(index)
        command = ["timeout", "-k", "5", str(LIMIT_S), sys.executable, "-m", module, *args]
        # Output to files, not pipes: a pipe nobody drains yet (the other host's, while this
        # one is waited for) fills up, with the import lines say, and stalls the collectives.
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=err)
        process.outputs = (out, err)
        processes.append(process)
    return processes


def _summaries(processes: list[subprocess.Popen], stderr: list[str] | None = None) -> list[dict]:
    """Wait for every process; each one's summary (the JSON line a stage prints last). Their
    stderr is appended to ``stderr`` when given."""
    try:
        for p in processes:
            p.wait(timeout=LIMIT_S + 30)
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    summaries = []
    for p in processes:
        out, err = (_read_back(file) for file in p.outputs)
        assert p.returncode == 0, f"exit {p.returncode}\n{err[-4000:]}"
        summaries.append(json.loads(out.strip().splitlines()[-1]))
        if stderr is not None:
            stderr.append(err)
    return summaries


def _read_back(file) -> str:
    """What a process wrote to ``file`` (a temporary file), which is then closed."""
    with file:
        file.seek(0)
        return file.read().decode()


def _run_both(
    module: str, args_of: dict[int, list[str]], stderr: list[str] | None = None
) -> dict[int, list[dict]]:
    """The 1-host and 2-host runs side by side; their summaries by host count."""
    ports = _free_ports(1)
    launched = {hosts: _launch(module, args, hosts, ports[0]) for hosts, args in args_of.items()}
    return {hosts: _summaries(processes, stderr) for hosts, processes in launched.items()}


def _without_timing(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not k.startswith("time/")}


def _params(model_dir: str) -> list[np.ndarray]:
    model, _ = load_model(model_dir)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def ppo_runs(inputs) -> dict[int, tuple[str, list[dict]]]:
    """PPO on 1 host x 8 devices and on 2 hosts x 4 (output folder, per-process summaries).

    The 2-host run stops after ITERATIONS - 1 and a second 2-host run resumes it from its
    checkpoint (restored by both processes, placed in chunks again) to ITERATIONS. With no
    warmup and a constant rate, the schedule does not depend on the iteration count.
    """
    common = ["--shards", inputs["shards"], "--policy", inputs["policy"]]
    common += ["--reward-model", inputs["reward"], *PPO_FLAGS]
    outputs = {hosts: os.path.join(inputs["root"], f"ppo-{hosts}") for hosts in (1, 2)}
    args = {h: [*common, "--output", out] for h, out in outputs.items()}
    ports = _free_ports(2)
    single = _launch("components.ppo", [*args[1], "--iterations", str(ITERATIONS)], 1, 0)
    try:
        first = _launch(
            "components.ppo", [*args[2], "--iterations", str(ITERATIONS - 1)], 2, ports[0]
        )
        assert _summaries(first)[0]["step"] == ITERATIONS - 1
        before = read_metrics(outputs[2])
        assert [r["step"] for r in before] == list(range(1, ITERATIONS))
        resumed = _launch(
            "components.ppo", [*args[2], "--iterations", str(ITERATIONS)], 2, ports[1]
        )
        summaries = {2: _summaries(resumed), 1: _summaries(single)}
    finally:
        for p in single:
            if p.poll() is None:
                p.kill()
    # It resumed: a run that started over would have rewritten these (each has its time).
    assert read_metrics(outputs[2])[: ITERATIONS - 1] == before
    return {hosts: (outputs[hosts], summaries[hosts]) for hosts in (1, 2)}


def test_ppo_on_two_hosts_matches_one_host(inputs, ppo_runs):
    (single, [want]), (multi, summaries) = ppo_runs[1], ppo_runs[2]
    # Every process ends with the same figures (gold reward included: one global measure).
    assert _without_timing(summaries[1]) == _without_timing(summaries[0])
    got = summaries[0]
    assert got.keys() == want.keys()
    for name in _without_timing(want):
        assert got[name] == pytest.approx(want[name], **CLOSE), name
    assert got["step"] == ITERATIONS and got["gold/initial"] == want["gold/initial"]

    initial = _params(inputs["policy"])
    moved = max(np.max(np.abs(a - b)) for a, b in zip(_params(single), initial, strict=True))
    assert moved > 1e-3  # the comparison below is not between two untouched copies
    # atol 1e-5: Adam divides each step by the root of its second moment, so a weight whose
    # gradients are ~0 turns ulps of summation order into ~1e-6 (measured: 1 of 4096
    # weights 1.05e-6 apart under Ziegler's controller; 8.3e-6 under the PI controller,
    # whose coefficient follows each rollout's KL more closely; every other within 2e-6).
    for a, b in zip(_params(multi), _params(single), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    records = {hosts: read_metrics(out) for hosts, (out, _) in ppo_runs.items()}
    assert [r["step"] for r in records[2]] == [r["step"] for r in records[1]] == [1, 2, 3]
    for got_row, want_row in zip(records[2], records[1], strict=True):
        assert got_row.keys() == want_row.keys()
        for name, value in want_row.items():
            if name == "time" or name.startswith("time/") or name == "stage":
                continue
            assert got_row[name] == pytest.approx(value, **CLOSE), (want_row["step"], name)
        # Counted from the sampled tokens: equal only if every response is the same.
        for name in ("response_length", "eos_fraction", "episode"):
            assert got_row[name] == want_row[name], name

    status = {}
    for hosts, (out, _) in ppo_runs.items():
        with open(os.path.join(out, "ppo_status.json")) as handle:
            status[hosts] = json.load(handle)
    assert status[2]["status"] == status[1]["status"] == "completed"
    assert status[2]["gold_reward"] == status[1]["gold_reward"]
    assert status[2]["final_kl_per_token"] == pytest.approx(
        status[1]["final_kl_per_token"], **CLOSE
    )
    # The multi-host checkpoint path ran (every iteration saved, the last 2 kept).
    for out, _ in ppo_runs.values():
        assert sorted(os.listdir(work_checkpoint_dir(out))) == ["2", "3"]


def _assert_close(got, want, path: str = "") -> None:
    """Equal structure; numbers within CLOSE, everything else (counts, flags, text) equal."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            _assert_close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_close(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, **CLOSE), path
    else:
        assert got == want, path


def _timeless(record: dict) -> dict:
    """``record`` without the run header's evaluation time (summary.run.evaluated)."""
    record = json.loads(json.dumps(record))
    for holder in (record, record.get("summary", {})):
        if isinstance(holder.get("run"), dict):
            holder["run"].pop("evaluated", None)
    return record


def test_evaluate_on_two_hosts_matches_one_host(inputs, ppo_runs):
    """Aligned = the 2-host PPO output, reference = the policy it started from."""
    aligned = ppo_runs[2][0]
    common = ["--shards", inputs["shards"], "--policy", aligned, "--reference", inputs["policy"]]
    common += ["--reward-model", inputs["reward"], *EVAL_FLAGS]
    outputs = {hosts: os.path.join(inputs["root"], f"eval-{hosts}") for hosts in (1, 2)}
    errors: list[str] = []
    summaries = _run_both(
        "components.evaluate", {h: [*common, "--output", out] for h, out in outputs.items()}, errors
    )
    # Eval pairs and prompts read with core's TFRecord reader: no process imported TensorFlow.
    for err in errors:
        imported = [line.split("|")[-1].strip() for line in err.splitlines() if "|" in line]
        assert "jax" in imported and not [m for m in imported if m.startswith("tensorflow")]
    # Every host computes the same figures (process 0 writes them); when each evaluated
    # (the report header's clock time) is the one thing that differs.
    summaries = {h: [_timeless(s) for s in found] for h, found in summaries.items()}
    assert summaries[2][1] == summaries[2][0]
    _assert_close(summaries[2][0], summaries[1][0])
    records = {}
    for hosts, out in outputs.items():
        with open(os.path.join(out, "eval.json")) as handle:
            records[hosts] = _timeless(json.load(handle))
    got, want = records[2], records[1]
    _assert_close(got, want)
    assert got["blessed"] == want["blessed"]
    assert got["summary"]["win_rate"] == want["summary"]["win_rate"]
    assert got["summary"]["kl"] == pytest.approx(want["summary"]["kl"], **CLOSE)
    # Not a tie of two identical policies: the measures have something to agree on.
    # k1 may read below 0 on a barely moved policy; its size is what shows it moved.
    assert abs(want["summary"]["kl"]["per_token"]) > 1e-4
    summary = want["summary"]
    coupled = summary["win_rate"]["coupled"]  # sample s with sample s: the same key
    assert coupled is None or coupled["ties"] < coupled["pairs"]
    assert summary["win_rate"]["ties"] < summary["win_rate"]["pairs"]


def test_reward_functions_on_two_hosts_match_one_host(inputs):
    """Each host scores its own rows with the reward functions; the figures are global (the
    functions' means over every host's responses), as one host computes them."""
    flags = ["--shards", inputs["shards"], "--policy", inputs["policy"], *PPO_FLAGS]
    flags += ["--reward-model", inputs["reward"], "--algorithm", "grpo", "--group-size", "4",
              "--rollout-batch-size", "32", "--iterations", "2",
              "--reward-functions", "builtin/length-penalty", "--reward-weights", "2"]  # fmt: skip
    outputs = {hosts: os.path.join(inputs["root"], f"grpo-functions-{hosts}") for hosts in (1, 2)}
    _run_both("components.ppo", {h: [*flags, "--output", out] for h, out in outputs.items()})
    records = {hosts: read_metrics(out) for hosts, out in outputs.items()}
    assert [r["step"] for r in records[2]] == [r["step"] for r in records[1]] == [1, 2]
    for got, want in zip(records[2], records[1], strict=True):
        for name in ("rewards/length_penalty/mean", "rewards/length_penalty/std", "reward"):
            assert got[name] == pytest.approx(want[name], **CLOSE), name
        assert got["rewards/unscorable_fraction"] == want["rewards/unscorable_fraction"] == 0.0
        assert got["objective/scores"] == pytest.approx(want["objective/scores"], **CLOSE)
    # The penalty is 0 up to 4/5 of the 8 new tokens: some responses ran past it.
    assert any(r["rewards/length_penalty/mean"] < 0 for r in records[1])
