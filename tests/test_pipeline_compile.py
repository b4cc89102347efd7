"""The compiled pipeline per target: DAG, conditions, TPU placement, images, caching, retries."""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path

import pytest
import yaml

from pipelines.cli.main import main
from pipelines.dag import param_table, params
from pipelines.dag.kfp_components import Components, build_components
from pipelines.dag.stages import downstream
from pipelines.targets.placement import Placement, PlacementError
from pipelines.targets.spec import compile_pipeline, read_spec
from pipelines.targets.vertex import jobs as vertex_jobs

TRAIN_IMAGE = "us-docker.pkg.dev/p/alignpipe/train:1"
DATA_IMAGE = "us-docker.pkg.dev/p/alignpipe/data:1"
# ppo-2: the ppo task of the reward-functions branch (no reward model).
TRAINING = ("sft", "reward", "ppo", "ppo-2", "dpo", "evaluate")
CPU_TASKS = ("builtin-data", "find-data", "shard", "check-policy", "promote", "plan-run")


def _compile(tmp_path: Path, target: str, values: dict | None = None, **placement) -> list:
    path = tmp_path / f"{target}.yaml"
    options = {"image": TRAIN_IMAGE, "data_image": DATA_IMAGE, **placement}
    compile_pipeline(Placement(target=target, **options), values or {}, path, None)
    return read_spec(path)


@pytest.fixture(scope="module")
def vertex(tmp_path_factory) -> dict:
    return _compile(tmp_path_factory.mktemp("vertex"), "vertex")[0]


@pytest.fixture(scope="module")
def gke(tmp_path_factory) -> list:
    return _compile(tmp_path_factory.mktemp("gke"), "gke", topology="2x4")


def _tasks(spec: dict) -> dict[str, dict]:
    """Every task of the pipeline by name, nested condition DAGs included."""
    found = dict(spec["root"]["dag"]["tasks"])
    for component in spec["components"].values():
        found.update(component.get("dag", {}).get("tasks", {}))
    return found


def _executor(spec: dict, task: str) -> dict:
    return spec["deploymentSpec"]["executors"][f"exec-{task}"]["container"]


def _branch(spec: dict, condition: str) -> dict[str, dict]:
    """The tasks of the condition DAG named ``condition``."""
    task = next(t for t in _tasks(spec).values() if t["taskInfo"]["name"] == condition)
    return spec["components"][task["componentRef"]["name"]]["dag"]["tasks"]


def _nested(spec: dict, task: dict) -> set[str]:
    """The names of every task inside ``task``'s condition DAGs, however deep."""
    inner = spec["components"][task["componentRef"]["name"]].get("dag", {}).get("tasks", {})
    return set(inner).union(*(_nested(spec, t) for t in inner.values()))


def _group_of(spec: dict, task_name: str) -> str:
    """The task of the training branch (new-data: a condition group or the task) that holds
    ``task_name``; at the pipeline level for tasks outside it."""
    for tasks in (_branch(spec, "new-data"), spec["root"]["dag"]["tasks"]):
        for name, task in tasks.items():
            if task_name == name or task_name in _nested(spec, task):
                return name
    raise KeyError(task_name)


def test_dag_order_and_conditions(vertex):
    tasks = _tasks(vertex)
    assert set(tasks["ppo"]["dependentTasks"]) >= {"reward"}
    # The training branches wait on the shards and the initial policy; evaluate on both.
    rl_group = _group_of(vertex, "ppo")
    assert _group_of(vertex, "dpo") == rl_group  # one If/Else group: one branch runs
    assert set(tasks[rl_group]["dependentTasks"]) >= {"shard", _group_of(vertex, "sft")}
    assert set(tasks["evaluate"]["dependentTasks"]) >= {rl_group, "shard"}
    conditions = {t["taskInfo"]["name"]: t.get("triggerPolicy", {}) for t in tasks.values()}
    # check-policy decides: sft trains without a base policy, or on it with sft_on_base.
    assert conditions["train-policy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--check-policy-Output'] == true"
    )
    assert conditions["warm-start"]["condition"].startswith("!(")
    assert tasks["check-policy"]["inputs"]["parameters"]["sft_on_base"] == {
        "componentInputParameter": "pipelinechannel--sft_on_base"
    }
    # sft starts from check-policy's fingerprinted reference, not the raw path.
    assert tasks["sft"]["inputs"]["parameters"]["base_policy"] == {
        "componentInputParameter": "pipelinechannel--check-policy-reference"
    }
    # The shard stage takes its tokenizer from the base models when none is given.
    shard_inputs = tasks["shard"]["inputs"]["parameters"]
    assert shard_inputs["base_policy"] == {
        "componentInputParameter": "pipelinechannel--base_policy"
    }
    assert conditions["builtin-data"]["condition"].endswith("data_uri'] == ''")
    assert conditions["blessed"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--evaluate-Output'] == true"
    )
    # promote is the only task of the branch the blessed condition guards
    blessed = next(t for t in tasks.values() if t["taskInfo"]["name"] == "blessed")
    branch = vertex["components"][blessed["componentRef"]["name"]]["dag"]["tasks"]
    assert list(branch) == ["promote"]
    assert set(blessed["dependentTasks"]) == {"evaluate", rl_group}


def test_training_runs_only_on_new_data(vertex):
    """plan-run decides; everything that trains is in its new-data branch, the no-new-data
    task in the other, and the run's one output is either branch's result."""
    tasks = _tasks(vertex)
    root = vertex["root"]["dag"]["tasks"]
    conditions = {t["taskInfo"]["name"]: t.get("triggerPolicy", {}) for t in tasks.values()}
    assert conditions["new-data"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--plan-run-new_data'] == true"
    )
    assert conditions["nothing-new"]["condition"].startswith("!(")
    inside = _nested(vertex, next(t for t in tasks.values() if t["taskInfo"]["name"] == "new-data"))
    expected = {"shard", "sft", "check-policy", "given-policy", "reward", "ppo", "dpo", "evaluate"}
    assert expected | {"promote"} <= inside
    assert "plan-run" in root and list(_branch(vertex, "nothing-new")) == ["no-new-data"]
    assert not tasks["plan-run"]["cachingOptions"].get("enableCache")
    assert tasks["plan-run"]["inputs"]["parameters"]["force_run"] == {
        "componentInputParameter": "force_run"
    }
    anchor = tasks["evaluate"]["inputs"]["parameters"]["anchor"]
    assert anchor == {"componentInputParameter": "pipelinechannel--plan-run-anchor"}
    outputs = vertex["root"]["dag"]["outputs"]["parameters"]
    assert list(outputs) == ["result"]
    assert outputs["result"]["valueFromParameter"]["producerSubtask"].startswith("condition-")


def test_algorithm_dpo_branch_replaces_reward_and_ppo(vertex):
    """algorithm=dpo runs the dpo task; the reward-model branch holds reward and ppo, the
    reward-functions branch (train_reward_model false) a ppo without a reward model; one
    OneOf reference feeds evaluate and promote."""
    tasks = _tasks(vertex)
    conditions = {t["taskInfo"]["name"]: t.get("triggerPolicy", {}) for t in tasks.values()}
    assert conditions["algorithm-dpo"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--algorithm'] == 'dpo'"
    )
    trained = "inputs.parameter_values['pipelinechannel--train_reward_model'] == true"
    assert conditions["reward-model"]["condition"].endswith(f"&& {trained}")
    assert conditions["reward-functions"]["condition"].endswith(f"&& !({trained})")
    assert list(_branch(vertex, "algorithm-dpo")) == ["dpo"]
    assert set(_branch(vertex, "reward-model")) == {"reward", "ppo"}
    assert set(_branch(vertex, "reward-functions")) == {"ppo-2"}
    dpo_inputs = tasks["dpo"]["inputs"]["parameters"]
    assert dpo_inputs["beta"] == {"componentInputParameter": "pipelinechannel--dpo_beta"}
    policy = tasks["evaluate"]["inputs"]["parameters"]["policy"]["taskOutputParameter"]
    assert policy["producerTask"] == _group_of(vertex, "ppo") == _group_of(vertex, "ppo-2")
    assert tasks["evaluate"]["inputs"]["parameters"]["reward_model"] == {
        "componentInputParameter": "pipelinechannel--eval_reward_model"
    }


def test_a_run_without_the_reward_stage_scores_with_its_functions(vertex, gke):
    """The reward-functions branch's ppo takes no reward model and the functions as
    parameters, on vertex and gke alike; the sft task reads the run's own sft shards too."""
    for spec in (vertex, gke[0]):
        tasks = _tasks(spec)
        scored = tasks["ppo-2"]["inputs"]
        assert set(scored["artifacts"]) == {"shards"}
        assert "reward" in tasks["ppo"]["inputs"]["artifacts"]
        for name in ("reward_functions", "reward_weights", "reward_timeout", "reward_workers"):
            assert scored["parameters"][name] == {
                "componentInputParameter": f"pipelinechannel--{name}"
            }
        assert set(tasks["sft"]["inputs"]["artifacts"]) == {"shards", "sft_shards"}
    compiled = vertex["root"]["inputDefinitions"]["parameters"]
    assert compiled["train_reward_model"]["defaultValue"] is True
    assert compiled["reward_functions"]["defaultValue"] == ""


def test_reward_gate_stops_the_run_before_ppo(vertex):
    """A reward model below min_reward_accuracy fails its task: nothing after it runs."""
    tasks = _tasks(vertex)
    compiled = vertex["root"]["inputDefinitions"]["parameters"]
    assert compiled["min_reward_accuracy"]["defaultValue"] == 0.6
    reward_inputs = tasks["reward"]["inputs"]["parameters"]
    assert reward_inputs["min_reward_accuracy"] == {
        "componentInputParameter": "pipelinechannel--min_reward_accuracy"
    }
    assert "triggerPolicy" not in tasks["reward"]  # it always runs, and gates by failing
    # ppo, evaluate and promote all wait on the reward task (evaluate on its branch group,
    # promote through evaluate).
    assert "reward" in tasks["ppo"]["dependentTasks"]
    assert _group_of(vertex, "reward") in tasks["evaluate"]["dependentTasks"]
    blessed = next(t for t in tasks.values() if t["taskInfo"]["name"] == "blessed")
    assert "evaluate" in blessed["dependentTasks"]


def test_shard_keeps_one_eval_batch_of_sft_and_reward(vertex):
    compiled = vertex["root"]["inputDefinitions"]["parameters"]
    assert compiled["min_eval_pairs"]["defaultValue"] == params.defaults()["sft_batch_size"] == 64
    shard_inputs = _tasks(vertex)["shard"]["inputs"]["parameters"]
    assert shard_inputs["min_eval_pairs"] == {
        "componentInputParameter": "pipelinechannel--min_eval_pairs"
    }
    # sft does not run on a warm start: only the reward batch must fit then.
    warm = {"base_policy": "gs://b/policy", "sft_batch_size": 128}
    assert params.validate(warm, chips=8)["min_eval_pairs"] == 64


def test_parameters_default_to_the_stage_configs(vertex):
    compiled = vertex["root"]["inputDefinitions"]["parameters"]
    assert set(compiled) == set(param_table.BY_NAME)
    for name, default in params.defaults().items():
        assert compiled[name].get("defaultValue", "") == default, name


def test_vertex_places_training_on_tpu_and_the_rest_on_cpu(vertex):
    """Training tasks launch a TPU custom job of the training image (tests/test_vertex_jobs.py
    checks those against aiplatform's types); other tasks get CPU and memory limits."""
    for task in TRAINING:
        container = _executor(vertex, task)
        assert container["image"] == vertex_jobs.LAUNCHER_IMAGE
        (pool,) = vertex_jobs.payload_of(container)["job_spec"]["worker_pool_specs"]
        assert pool["container_spec"]["image_uri"] == TRAIN_IMAGE
        assert pool["machine_spec"] == {"machine_type": "ct5lp-hightpu-4t", "tpu_topology": "2x2"}
    for task in CPU_TASKS:
        container = _executor(vertex, task)
        assert "accelerator" not in container["resources"]
        assert container["resources"]["resourceCpuLimit"] == "4"
        assert container["resources"]["resourceMemoryLimit"] == "16G"
    for task in ("builtin-data", "find-data", "shard"):
        assert _executor(vertex, task)["image"] == DATA_IMAGE
    # kfp comes with the image: no task installs packages when it starts.
    assert "pip install" not in yaml.safe_dump(vertex["deploymentSpec"])


def test_retries_on_training_tasks_only(vertex):
    tasks = _tasks(vertex)
    for task in TRAINING:
        policy = tasks[task]["retryPolicy"]
        assert policy["maxRetryCount"] == 3 and policy["backoffDuration"] == "60s"
    for task in CPU_TASKS:
        assert "retryPolicy" not in tasks[task]


def test_caching_on_except_for_listings_and_promote(vertex):
    tasks = _tasks(vertex)
    for task in ("builtin-data", "shard", "sft", "reward", "ppo", "evaluate"):
        assert tasks[task]["cachingOptions"].get("enableCache") is True, task
    # A glob and a promoted folder change behind the same string: always re-read; a
    # promotion is a side effect that a cache hit would skip.
    for task in ("find-data", "check-policy", "plan-run", "no-new-data", "promote"):
        assert not tasks[task]["cachingOptions"].get("enableCache"), task


def test_fresh_from_ppo_turns_caching_off_downstream(tmp_path):
    path = tmp_path / "fresh.yaml"
    placement = Placement(target="vertex", image=TRAIN_IMAGE)
    compile_pipeline(placement, {}, path, fresh_from="ppo")
    tasks = _tasks(read_spec(path)[0])
    for task in ("ppo", "evaluate", "promote"):
        assert not tasks[task]["cachingOptions"].get("enableCache"), task
    for task in ("shard", "sft", "reward"):
        assert tasks[task]["cachingOptions"]["enableCache"] is True, task
    assert downstream("sft") == ("sft", "ppo", "dpo", "evaluate", "promote")
    assert downstream("shard") == ("shard", "sft", "reward", "ppo", "dpo", "evaluate", "promote")
    assert downstream("dpo") == ("dpo", "evaluate", "promote")


def test_local_image_names_the_code_so_a_code_change_misses_the_cache(tmp_path, monkeypatch):
    """kfp.local caches by the task spec, image reference included; the local runner runs
    this checkout's code, so the reference changes with every Python file the tasks run."""
    import components
    from pipelines.targets.local import run

    for name in ("components/__init__.py", "components/ppo/rollout.py", "pipelines/dag/x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    monkeypatch.setattr(components, "__file__", str(tmp_path / "components" / "__init__.py"))
    first = run.source_image()
    assert first.startswith("python:3.11-src-") and first == run.source_image()
    (tmp_path / "components" / "ppo" / "notes.txt").write_text("not code")
    assert run.source_image() == first
    (tmp_path / "components" / "ppo" / "rollout.py").write_text("# changed\n")
    changed = run.source_image()
    assert changed != first
    (tmp_path / "pipelines" / "dag" / "x.py").write_text("# changed too\n")
    assert run.source_image() not in (first, changed)


def test_gke_node_selectors_limit_and_toleration(gke):
    spec, platform = gke
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == {f"exec-{t}" for t in TRAINING}
    for task in TRAINING:
        k8s = executors[f"exec-{task}"]
        assert k8s["nodeSelector"]["labels"] == {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
            "cloud.google.com/gke-tpu-topology": "2x4",
        }
        assert k8s["tolerations"] == [
            {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        accelerator = _executor(spec, task)["resources"]["accelerator"]
        assert accelerator["resourceType"] == "google.com/tpu"
        assert accelerator["resourceCount"] == "8"


def test_compile_time_values_become_defaults(tmp_path):
    spec = _compile(tmp_path, "vertex", {"ppo_iterations": 7, "kl_coef": 0.2})[0]
    compiled = spec["root"]["inputDefinitions"]["parameters"]
    assert compiled["ppo_iterations"]["defaultValue"] == 7
    assert compiled["kl_coef"]["defaultValue"] == 0.2


@pytest.mark.parametrize(
    ("values", "placement", "message"),
    [
        ({"sft_batch_size": 6}, {}, "sft_batch_size: 6 does not split over 4 chips"),
        ({"ppo_rollout_batch_size": 12}, {}, "multiple of 4 chips x 2 ppo_minibatches"),
        ({"reward_batch_size": 12}, {"topology": "2x4"}, "over 8 chips"),
        ({"preset": "huge"}, {}, "preset: 'huge' is not a model preset"),
        ({"sft_steps": -5}, {}, "steps: -5 must be at least 1"),
        ({"ppo_iterations": 0}, {}, "iterations: 0 must be at least 1"),
        ({"kl_coef": "x"}, {}, "kl_coef: expected float"),
        # JSON has no inf: the spec would not serialize (the stage itself takes inf).
        ({"max_kl": float("inf")}, {}, r"max_kl: inf: .* finite numbers \(to turn the check off"),
        (
            {"kl_coef": float("nan")},
            {},
            r"kl_coef: nan: pipeline parameters must be finite numbers$",
        ),
        ({"no_such": 1}, {}, "unknown parameter"),
        ({"data_columns": "question"}, {}, "shard parameters: columns: not JSON"),
        ({"sft_data_columns": '{"a": "prompt", "b": "prompt"}'}, {}, "sft_data_columns: .*same"),
        ({"reward_batch_size": 128}, {}, "min_eval_pairs: 64 is below reward_batch_size 128"),
        ({"min_eval_pairs": -1}, {}, "min_eval_pairs: -1 must be >= 0"),
        ({"min_reward_accuracy": 1.5}, {}, "min_reward_accuracy: 1.5 must be in"),
        ({"algorithm": "a2c"}, {}, "algorithm: 'a2c' is unknown"),
        ({"algorithm": "dpo", "data_uri": "gs://b/p.jsonl"}, {}, "evaluate has no judge"),
        ({"algorithm": "dpo", "dpo_batch_size": 6}, {}, "dpo_batch_size: 6 does not split"),
        ({"algorithm": "dpo", "dpo_beta": 0.0}, {}, "dpo parameters: beta: 0.0 must be > 0"),
        (
            {"algorithm": "grpo", "group_size": 8, "ppo_rollout_batch_size": 16},
            {},
            "4 chips x group",
        ),
    ],
)
def test_bad_parameters_refused_before_writing(tmp_path, values, placement, message):
    path = tmp_path / "bad.yaml"
    options = {"target": "vertex", "image": TRAIN_IMAGE, **placement}
    with pytest.raises(params.ParamError, match=message):
        compile_pipeline(Placement(**options), values, path)
    assert not path.exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"target": "aws"}, "target: 'aws' is unknown"),
        ({"target": "vertex", "image": ""}, "needs the training image"),
        ({"target": "gke", "topology": "3x3"}, "not a single-host v5e slice"),
        ({"target": "vertex", "machine_type": "ct5lp-hightpu-8t"}, "use ct5lp-hightpu-4t"),
        ({"target": "vertex", "tpu": "v9"}, "tpu: 'v9' is unknown"),
        ({"target": "vertex", "tpu": "v5p", "topology": "2x2"}, "not a single-host v5p slice"),
        (
            {"target": "vertex", "tpu": "v5p", "topology": "2x2x1", "machine_type": "ct5p-8t"},
            "use ct5p-hightpu-4t",
        ),
        ({"target": "vertex", "image": "r/train:latest"}, "tag 'latest' moves"),
    ],
)
def test_bad_placement_refused(options, message):
    with pytest.raises(PlacementError, match=message):
        Placement(**{"image": TRAIN_IMAGE, **options})


def test_cli_compile_writes_a_spec_or_refuses(tmp_path, capsys):
    out = tmp_path / "g.yaml"
    base = ["compile", "--target", "gke", "--image", TRAIN_IMAGE, "-o", str(out)]
    assert main(base + ["--tpu-topology", "2x4", "--sft-steps", "12"]) == 0
    spec = read_spec(out)[0]
    assert spec["root"]["inputDefinitions"]["parameters"]["sft_steps"]["defaultValue"] == 12
    out.unlink()
    assert main(base + ["--sft-batch-size", "10"]) == 2
    assert "sft_batch_size: 10 does not split over 4 chips" in capsys.readouterr().err
    assert not out.exists()
    # The done-when command: no image given, the spec names the default tag.
    assert main(["compile", "--target", "vertex", "-o", str(out)]) == 0
    assert "alignpipe/train:0.1.0" in out.read_text()


def test_components_take_exactly_their_stage_fields():
    built = build_components("python:3.11")
    stage_of = {"shard": "shard", "sft": "sft", "reward": "reward", "ppo": "ppo", "dpo": "dpo"}
    stage_of["evaluate"] = "evaluate"
    for component, stage in stage_of.items():
        fields = set(params.stage_values(stage, params.defaults()))
        signature = inspect.signature(getattr(built, component).python_func)
        config_fields = {f.name for f in dataclasses.fields(param_table.STAGE_CONFIGS[stage])}
        taken = set(signature.parameters) & config_fields
        assert taken == fields, component
    assert set(Components._fields) >= set(stage_of)


def test_placement_chips_and_machine_type():
    placement = Placement(target="vertex", image=TRAIN_IMAGE, topology="2x4")
    assert placement.chips == math.prod((2, 4)) == 8
    assert placement.describe()["machine-type"] == "ct5lp-hightpu-8t"
    assert Placement(target="local", cpu_devices=8).chips == 8


def test_images_build_config():
    containers = Path(__file__).resolve().parents[1] / "containers"
    build = yaml.safe_load((containers / "cloudbuild.yaml").read_text())
    files = {step["args"][1] for step in build["steps"]}
    assert files == {"--file=containers/Dockerfile.train", "--file=containers/Dockerfile.data"}
    assert {image.rsplit("/", 1)[1].split(":")[0] for image in build["images"]} == {
        "train",
        "data",
    }
    # No default tag: a build names its tag (never latest, see targets._check_image).
    assert "_TAG" not in build["substitutions"]
    for name in ("Dockerfile.train", "Dockerfile.data"):
        lines = (containers / name).read_text().splitlines()
        base = next(line for line in lines if line.startswith("ARG ") and "_IMAGE=" in line)
        assert ":latest" not in base and base.split(":")[-1][0].isdigit(), base
        # The training image has the cloud extra; the data image cannot (aiplatform>=2 against
        # apache-beam[gcp]'s <2) and needs none of it.
        project = '".[${EXTRAS}]"' if name == "Dockerfile.train" else '"."'
        assert any("pip install" in line and project in line for line in lines)
        if name == "Dockerfile.train":  # the extras default to cloud; trackers add theirs
            assert "ARG EXTRAS=cloud" in lines
    users = {
        name: [line for line in (containers / name).read_text().splitlines()
               if line.startswith("USER ")]
        for name in ("Dockerfile.train", "Dockerfile.data")
    }  # fmt: skip
    assert users["Dockerfile.train"] == ["USER 10001:10001"]  # training never runs as root
    # The data image is also a Dataflow worker image, and Dataflow runs those as root.
    assert users["Dockerfile.data"] == []


def test_make_compile_binds_the_pushed_digests():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    push = makefile[makefile.index("\npush:") : makefile.index("\ncompile:")]
    assert "@sha256:" in push and "$(IMAGES_ENV)" in push
    compile_ = makefile[makefile.index("\ncompile:") :]
    assert "--image $(or $(TRAIN_DIGEST),$(TRAIN_IMAGE))" in compile_
    assert "--data-image $(or $(DATA_DIGEST),$(DATA_IMAGE))" in compile_


def test_empty_tokenizer_means_the_datas_own():
    from pipelines import stage_io

    assert params.defaults()["tokenizer"] == ""
    builtin = [{"uri": "a/pairs.jsonl", "tokenizer": "builtin-words"}]
    assert stage_io.data_tokenizer(builtin) == "builtin-words"
    assert stage_io.data_tokenizer([{"uri": "gs://b/p.jsonl"}]) == "byte"
    assert stage_io.data_tokenizer(builtin + [{"uri": "gs://b/p.jsonl"}]) == "byte"
