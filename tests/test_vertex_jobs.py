"""Vertex training tasks as TPU custom jobs, checked against aiplatform_v1's own types.

The GCPC launcher turns its ``--payload`` into ``aiplatform_v1.types.CustomJob`` when it
creates the job (``create_custom_job(parent, custom_job=dict)``); building the same type
from each compiled payload here makes a wrong field name fail offline.
"""

from __future__ import annotations

import datetime
import inspect
import json
from pathlib import Path

import pytest
from google.cloud.aiplatform_v1.types import CustomJob, CustomJobSpec

from pipelines.cli.main import main
from pipelines.targets.placement import HOSTS_ENV, Placement, PlacementError
from pipelines.targets.spec import compile_pipeline, read_spec
from pipelines.targets.vertex import custom_job_retry
from pipelines.targets.vertex import jobs as vertex_jobs

DIGEST = "@sha256:" + "ab" * 32
TRAIN_IMAGE = "us-docker.pkg.dev/p/alignpipe/train" + DIGEST
DATA_IMAGE = "us-docker.pkg.dev/p/alignpipe/data" + DIGEST
TRAINING = ("sft", "reward", "ppo", "dpo", "evaluate")
# What Vertex puts in the placeholders when the task starts.
RUNTIME = {
    vertex_jobs.SERVICE_ACCOUNT: "runner@proj.iam.gserviceaccount.com",
}
# (tpu, topology) -> the machine type each host of the slice is.
SLICES = {
    ("v5e", "1x1"): "ct5lp-hightpu-1t",
    ("v5e", "2x2"): "ct5lp-hightpu-4t",
    ("v5e", "2x4"): "ct5lp-hightpu-8t",
    ("v5p", "2x2x1"): "ct5p-hightpu-4t",
    ("v6e", "2x2"): "ct6e-standard-4t",
    ("v6e", "2x4"): "ct6e-standard-8t",
}


def _spec(path: Path, **placement) -> dict:
    options = {"target": "vertex", "image": TRAIN_IMAGE, "data_image": DATA_IMAGE, **placement}
    compile_pipeline(Placement(**options), {}, path)
    return read_spec(path)[0]


def _container(spec: dict, task: str) -> dict:
    return spec["deploymentSpec"]["executors"][f"exec-{task}"]["container"]


def _job(container: dict, executor_input: dict | None = None) -> CustomJob:
    """The CustomJob the launcher would create, placeholders filled as Vertex fills them."""
    args = container["args"]
    payload = args[args.index("--payload") + 1]
    for placeholder, value in RUNTIME.items():
        payload = payload.replace(placeholder, value)
    # Vertex substitutes the executor input JSON-escaped once, into a JSON string.
    escaped = json.dumps(json.dumps(executor_input or {"inputs": {}}))[1:-1]
    payload = payload.replace(vertex_jobs.EXECUTOR_INPUT_IN_JSON, escaped)
    return CustomJob(json.loads(payload))


@pytest.mark.parametrize(("tpu", "topology"), list(SLICES))
def test_training_tasks_are_custom_jobs_with_the_tpu_worker_pool(tmp_path, tpu, topology):
    spec = _spec(tmp_path / "v.yaml", tpu=tpu, topology=topology)
    for task in TRAINING:
        container = _container(spec, task)
        assert container["image"] == vertex_jobs.LAUNCHER_IMAGE
        assert container["command"][:3] == ["python3", "-u", "-c"]  # custom_job_retry, then
        assert vertex_jobs.LAUNCHER_MODULE in container["command"][3]  # GCPC's launcher
        assert "resources" not in container  # the launcher is a small CPU task
        job = _job(container)
        assert job.display_name == f"alignpipe-{task}"
        assert job.labels["stage"] == task and job.labels["tpu_topology"] == topology
        assert job.job_spec.service_account == RUNTIME[vertex_jobs.SERVICE_ACCOUNT]
        (pool,) = job.job_spec.worker_pool_specs
        assert pool.machine_spec.machine_type == SLICES[tpu, topology]
        assert pool.machine_spec.tpu_topology == topology
        assert pool.replica_count == 1  # one host per single-host slice
        assert pool.container_spec.image_uri == TRAIN_IMAGE
        assert pool.container_spec.args[-1] == task  # --function_to_execute
        env = {e.name: e.value for e in pool.container_spec.env}
        assert env == {"ALIGNPIPE_ROLE": "train", HOSTS_ENV: "1"}
        # The same pool is a valid CustomJobSpec on its own.
        CustomJobSpec({"worker_pool_specs": [CustomJob.to_dict(job)["job_spec"]
                                             ["worker_pool_specs"][0]]})  # fmt: skip


def test_the_executor_input_reaches_the_stage_unchanged(tmp_path):
    """The stage's kfp executor gets exactly the task's executor input, quotes and all."""
    spec = _spec(tmp_path / "v.yaml")
    executor_input = {"inputs": {"parameterValues": {"prompt": 'say "hi"\n', "steps": 3}}}
    job = _job(_container(spec, "sft"), executor_input)
    args = list(job.job_spec.worker_pool_specs[0].container_spec.args)
    assert json.loads(args[args.index("--executor_input") + 1]) == executor_input


def test_the_launcher_writes_gcp_resources_and_other_tasks_keep_their_containers(tmp_path):
    spec = _spec(tmp_path / "v.yaml")
    for task in TRAINING:
        container = _container(spec, task)
        at = container["args"].index("--gcp_resources") + 1
        assert container["args"][at] == "{{$.outputs.parameters['gcp_resources'].output_file}}"
        outputs = spec["components"][f"comp-{task}"]["outputDefinitions"]
        assert outputs["parameters"]["gcp_resources"] == {"parameterType": "STRING"}
        assert outputs["artifacts"]  # the stage's own outputs are kept
        assert container["args"][container["args"].index("--project") + 1] == vertex_jobs.PROJECT
    assert "Output" in spec["components"]["comp-sft"]["outputDefinitions"]["parameters"]
    for task in ("builtin-data", "find-data", "shard", "plan-run", "check-policy", "promote"):
        container = _container(spec, task)
        assert container["image"] in (TRAIN_IMAGE, DATA_IMAGE), task
        assert container["resources"]["resourceCpuLimit"] == "4"


def test_a_wrong_field_name_fails_here():
    pool = vertex_jobs.worker_pool({"image": "i", "args": ["{{$}}"]}, "ct5lp-hightpu-4t", "2x2")
    pool["machine_spec"]["topology"] = pool["machine_spec"].pop("tpu_topology")
    with pytest.raises(ValueError, match="Unknown field for MachineSpec: topology"):
        CustomJob(vertex_jobs.custom_job("x", pool, {}))


def test_run_preset_v5e_8_1b_compiles_to_ct5lp_hightpu_8t_2x4(tmp_path, capsys):
    out = tmp_path / "preset.yaml"
    argv = ["compile", "--target", "vertex", "--image", TRAIN_IMAGE, "-o", str(out)]
    assert main(argv + ["--run-preset", "v5e-8-1b"]) == 0
    assert "warning" not in capsys.readouterr().err  # a digest: nothing to warn about
    pool = _job(_container(read_spec(out)[0], "ppo")).job_spec.worker_pool_specs[0]
    assert (pool.machine_spec.machine_type, pool.machine_spec.tpu_topology) == (
        "ct5lp-hightpu-8t", "2x4",
    )  # fmt: skip


def test_run_preset_v5p_32_7b_is_one_pool_over_the_four_hosts_of_its_slice(tmp_path, capsys):
    out = tmp_path / "7b.yaml"
    argv = ["compile", "--target", "vertex", "--image", TRAIN_IMAGE, "-o", str(out)]
    assert main(argv + ["--run-preset", "v5p-32-7b"]) == 0
    # Vertex's training docs list v5e, v6e and TPU7x machine types, not v5p: said, not hidden.
    assert "Vertex custom training documents" in capsys.readouterr().err
    spec = read_spec(out)[0]
    for task in TRAINING:
        job = _job(_container(spec, task))
        (pool,) = job.job_spec.worker_pool_specs
        assert pool.machine_spec.machine_type == "ct5p-hightpu-4t"  # each host: 4 chips
        assert pool.machine_spec.tpu_topology == "2x2x4"  # v5p-32: 16 chips, 4 hosts
        assert pool.replica_count == 1  # Vertex TPU pools take one replica, run on every VM
        assert {e.name: e.value for e in pool.container_spec.env}[HOSTS_ENV] == "4"
        assert job.labels["tpu_hosts"] == "4"
        CustomJobSpec(CustomJob.to_dict(job)["job_spec"])
    values = spec["root"]["inputDefinitions"]["parameters"]
    assert values["sft_batch_size"]["defaultValue"] == 128  # the preset's, over 16 chips


def test_v6e_4x4_is_four_ct6e_standard_4t_hosts():
    placement = Placement(target="vertex", image=TRAIN_IMAGE, tpu="v6e", topology="4x4")
    assert (placement.chips, placement.hosts, placement.machine) == (16, 4, "ct6e-standard-4t")
    assert placement.warnings() == []  # a digest and a TPU Vertex documents
    pool = vertex_jobs.worker_pool({"image": "i"}, placement.machine, placement.topology)
    CustomJobSpec({"worker_pool_specs": [pool]})
    with pytest.raises(PlacementError, match="ct5lp-hightpu-4t"):
        Placement(target="vertex", image=TRAIN_IMAGE, topology="4x4", machine_type="x-8t")


def test_cli_machine_type_is_written_or_refused(tmp_path, capsys):
    out = tmp_path / "m.yaml"
    argv = ["compile", "--target", "vertex", "--image", TRAIN_IMAGE, "-o", str(out)]
    argv += ["--tpu", "v6e", "--tpu-topology", "2x4"]
    assert main(argv + ["--machine-type", "ct6e-standard-8t"]) == 0
    pool = _job(_container(read_spec(out)[0], "sft")).job_spec.worker_pool_specs[0]
    assert pool.machine_spec.machine_type == "ct6e-standard-8t"
    assert main(argv + ["--machine-type", "ct6e-standard-4t"]) == 2
    assert "use ct6e-standard-8t" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ("us-docker.pkg.dev/p/alignpipe/train:latest", "tag 'latest' moves"),
        ("us-docker.pkg.dev/p/alignpipe/train", "no tag means latest"),
        ("localhost:5000/train", "no tag means latest"),  # a registry port is not a tag
    ],
)
def test_mutable_images_refused(image, message):
    with pytest.raises(PlacementError, match=message):
        Placement(target="vertex", image=image)
    with pytest.raises(PlacementError, match="--data-image"):
        Placement(target="gke", image=TRAIN_IMAGE, data_image=image)


def test_tags_warn_and_digests_do_not(tmp_path, capsys):
    assert Placement(target="vertex", image=TRAIN_IMAGE, data_image=DATA_IMAGE).warnings() == []
    tagged = Placement(target="vertex", image="r/train:3f2a9c1", data_image=DATA_IMAGE)
    (warning,) = tagged.warnings()
    assert warning.startswith("--image r/train:3f2a9c1 is a tag, not a digest")
    out = tmp_path / "t.yaml"
    assert main(["compile", "--target", "gke", "--image", "r/train:3f2a9c1", "-o", str(out)]) == 0
    assert "warning: --image r/train:3f2a9c1 is a tag" in capsys.readouterr().err


# Issue 40, items 4, 5 and 6 on the compiled run presets.
HOURS = datetime.timedelta(hours=1)
PRESET_TIMEOUTS = {"sft": 24, "reward": 24, "dpo": 24, "ppo": 48, "evaluate": 12}


@pytest.fixture(scope="module")
def preset_specs(tmp_path_factory) -> dict[str, dict]:
    """v5e-8-1b (one host) and v5p-32-7b (four hosts), compiled for vertex."""
    specs = {}
    for preset in ("v5e-8-1b", "v5p-32-7b"):
        out = tmp_path_factory.mktemp("presets") / f"{preset}.yaml"
        argv = ["compile", "--target", "vertex", "--image", TRAIN_IMAGE, "--run-preset", preset]
        assert main([*argv, "-o", str(out)]) == 0
        specs[preset] = read_spec(out)[0]
    return specs


@pytest.mark.parametrize("preset", ["v5e-8-1b", "v5p-32-7b"])
def test_a_restarted_worker_restarts_the_job_and_each_stage_has_a_bound(preset_specs, preset):
    """aiplatform_v1 Scheduling: restart_job_on_worker_restart "restarts the entire CustomJob
    if a worker gets restarted"; timeout "the maximum job running time. The default is 7
    days." Both checked as the types Vertex's API takes."""
    for task, hours in PRESET_TIMEOUTS.items():
        container = _container(preset_specs[preset], task)
        payload = vertex_jobs.payload_of(container)
        assert payload["job_spec"]["scheduling"] == {
            "restart_job_on_worker_restart": True,
            "timeout": f"{hours * 3600}s",
        }
        job = _job(container)
        scheduling = job.job_spec.scheduling
        assert scheduling.restart_job_on_worker_restart is True
        assert scheduling.timeout == hours * HOURS and not scheduling.disable_retries
        CustomJobSpec(CustomJob.to_dict(job)["job_spec"])


def test_train_timeout_overrides_every_stage_and_nonsense_is_refused(tmp_path):
    spec = _spec(tmp_path / "t.yaml", train_timeout_h=6.5)
    for task in TRAINING:
        assert _job(_container(spec, task)).job_spec.scheduling.timeout == 6.5 * HOURS
    assert vertex_jobs.scheduling("smoke-check")["timeout"] == "3600s"
    with pytest.raises(PlacementError, match="train_timeout"):
        Placement(target="vertex", image=TRAIN_IMAGE, train_timeout_h=-1)
    with pytest.raises(ValueError, match="Unknown field for Scheduling"):
        CustomJobSpec({"scheduling": {"restart_job_on_worker_restarts": True}})


@pytest.mark.parametrize("preset", ["v5e-8-1b", "v5p-32-7b"])
def test_a_retried_task_goes_through_custom_job_retry_to_gcpcs_launcher(preset_specs, preset):
    """GCPC 2.22's launcher re-polls the job its gcp_resources file names and raises on a
    FAILED one (container/v1/gcp_launcher/job_remote_runner.py): the command first clears
    such a job (pipelines/targets/vertex/custom_job_retry.py), then runs the launcher with the
    same args."""
    for task in TRAINING:
        container = _container(preset_specs[preset], task)
        assert container["image"] == "gcr.io/ml-pipeline/google-cloud-pipeline-components:2.22.0"
        assert container["command"] == ["python3", "-u", "-c", inspect.getsource(custom_job_retry)]
        args = container["args"]
        assert args[:2] == ["--type", "CustomJob"] and "--gcp_resources" in args
        assert custom_job_retry.flag(args, "--location") == vertex_jobs.LOCATION


def test_the_launcher_image_is_gcpc_2_22_by_tag():
    """No digest of the image is published where it can be cited (GCPC's _image.py, its
    RELEASE.md and compiled samples name the tag): the tag GCPC's own code uses is kept."""
    assert (
        vertex_jobs.LAUNCHER_IMAGE == "gcr.io/ml-pipeline/google-cloud-pipeline-components:2.22.0"
    )
