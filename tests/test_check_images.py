"""containers/check_images.py (``make check-images``): what it reads from the Dockerfiles and
from pip, offline. The resolution and the venvs themselves need a registry: `make
check-images`, not `make test`."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location(
        "check_images", ROOT / "containers/check_images.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_images"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


check = _load()

# pip 26's output for a set that cannot resolve (kfp 2.17.3 with protobuf<4), noise included.
PIP_CONFLICT = "\n".join(
    [
        "Collecting kubernetes<31,>=8.0.0 (from kfp==2.17.3)",
        "  Downloading kubernetes-30.1.0-py2.py3-none-any.whl (1.7 MB)",
        "INFO: pip is looking at multiple versions of kfp to determine which version is ...",
        "ERROR: Ignored the following versions that require a different python version: "
        "0.11.0 Requires-Python >=3.12",
        "ERROR: Cannot install kfp==2.17.3 and protobuf<4 because these package versions have "
        "conflicting dependencies.",
        "",
        "The conflict is caused by:",
        "    The user requested protobuf<4",
        "    kfp 2.17.3 depends on protobuf<7.0 and >=6.31.1",
        "",
        "To fix this you could try to:",
        "1. loosen the range of package versions you've specified",
        "2. remove package versions to allow pip to attempt to solve the dependency conflict",
        "",
        "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/...",
    ]
)


def test_the_images_requirements_come_from_their_dockerfiles():
    train = check.parse_dockerfile(ROOT / check.IMAGES["train"].dockerfile)
    assert train.python == "3.11"
    assert train.pip_args == [".[cloud]", "jax[tpu]==0.10.2", "kfp==2.17.3"]
    assert "import components, pipelines, jax" in train.build_checks[0]
    data = check.parse_dockerfile(ROOT / check.IMAGES["data"].dockerfile)
    assert data.python == "3.11"
    beam = re.search(r"_sdk:([\d.]+)", data.base_image).group(1)
    assert f"apache-beam[gcp]=={beam}" in data.pip_args


def test_parsing_follows_args_continuations_and_comments(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "# syntax=docker/dockerfile:1.7\n"
        "ARG BASE=python:3.11-slim\n"
        "FROM ${BASE}\n"
        'ARG JAX="0.10.2"\n'
        "RUN apt-get update \\\n"
        "    # comments inside a RUN are dropped, as Docker drops them\n"
        '    && python -m pip install --no-cache-dir ".[cloud]" "jax==${JAX}" kfp==$JAX \\\n'
        '    && python -c "import jax"\n'
    )
    parsed = check.parse_dockerfile(dockerfile)
    assert parsed.base_image == "python:3.11-slim" and parsed.python == "3.11"
    assert parsed.pip_args == ["--no-cache-dir", ".[cloud]", "jax==0.10.2", "kfp==0.10.2"]
    assert parsed.build_checks == ["import jax"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FROM python:3.11\nRUN pip install jax==${JAX}\n", r"\$JAX has no ARG JAX=DEFAULT"),
        ("FROM python:3.11\nRUN pip install a\nRUN pip install b\n", "2 `pip install` commands"),
        ("FROM debian:12\nRUN pip install a\n", "does not name its Python"),
        ("RUN pip install a\n", "no FROM line"),
    ],
)
def test_dockerfiles_the_check_cannot_read_are_refused_by_name(tmp_path, text, message):
    dockerfile = tmp_path / "Dockerfile.x"
    dockerfile.write_text(text)
    with pytest.raises(check.CheckError, match=message) as raised:
        check.parse_dockerfile(dockerfile)
    assert "Dockerfile.x" in str(raised.value)


def test_a_conflict_names_the_packages_without_pips_advice():
    explained = check.conflict(PIP_CONFLICT)
    assert explained.splitlines()[0].startswith("ERROR: Cannot install kfp==2.17.3 and protobuf<4")
    assert "kfp 2.17.3 depends on protobuf<7.0 and >=6.31.1" in explained
    for noise in ("Collecting", "Ignored the following", "To fix this", "loosen the range"):
        assert noise not in explained


def test_pins_leave_out_the_local_project():
    report = [
        {"metadata": {"name": "alignpipe", "version": "0.1.0"}, "download_info": {"dir_info": {}}},
        {"metadata": {"name": "jax", "version": "0.10.2"}, "download_info": {"url": "https://x"}},
        {"metadata": {"name": "flax", "version": "0.12.8"}, "download_info": {"url": "https://y"}},
    ]
    assert check.pins(report) == ["flax==0.12.8", "jax==0.10.2"]


def test_each_image_imports_what_its_tasks_import():
    train = check.import_targets(check.IMAGES["train"])
    for stage in ("sft", "reward", "ppo", "dpo", "evaluate"):
        assert f"components.{stage}.stage" in train
    assert {
        "pipelines:stage_io",
        "pipelines.targets.smoke_task",
        "pipelines.targets.gke.launcher",
    } <= set(train)
    data = check.import_targets(check.IMAGES["data"])
    assert (
        "components.shard.stage" in data and "components.core.data.builtin_task:write_jsonl" in data
    )
    assert "apache_beam.runners.worker.sdk_worker_main" in data  # the Dataflow worker harness
    assert not any(t.startswith(("components.ppo", "components.sft")) for t in data)


def test_a_beam_image_must_install_its_base_images_beam(tmp_path):
    dockerfile = check.Dockerfile(
        tmp_path / "Dockerfile.data", "apache/beam_python3.11_sdk:2.77.0", "3.11", [], []
    )
    same = [{"metadata": {"name": "apache-beam", "version": "2.77.0"}}]
    check.check_beam_version(dockerfile, same)
    other = [{"metadata": {"name": "apache-beam", "version": "2.78.0"}}]
    with pytest.raises(
        check.CheckError, match="ships Beam 2.77.0 but .* resolves apache-beam 2.78"
    ):
        check.check_beam_version(dockerfile, other)
