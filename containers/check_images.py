"""Check each image's Python dependency set on this machine, without Docker.

For every image (``make check-images``):

1. Read the Dockerfile: its ``pip install`` line is the one source of the image's
   requirements (``ARG`` defaults substituted, as ``docker build`` does), its base image
   names the Python, and the ``python -c`` check after the install is run too.
2. Resolve that requirement set with pip in a CPython venv of the image's Python
   (``pip install --dry-run --ignore-installed --report``): what ``docker build`` would
   resolve. When it does not resolve, pip's conflict (the packages named) is printed.
3. Install exactly the resolved set into a throwaway venv under ``build/image-check``,
   named by a hash of that set so a rerun reuses it; the project itself is reinstalled
   from the work tree each time (non-editable, like the image), and ``pip check`` runs.
4. From outside the work tree, import what the image's tasks import: every component
   body's imports (``pipelines/dag/kfp_components.py``), the stages' modules, ``python -m
   components.STAGE --help``; the training image also runs the smoke check (one pmap step,
   CPU); the data image the Beam worker harness and its Beam version against the base's.

Why resolve natively rather than with ``pip --platform manylinux... --only-binary=:all:``:
pip refuses source distributions when it emulates another platform, and kfp-server-api
is published only as one, so that dry run cannot resolve the training image at all. This
machine (CPython 3.11, Linux x86_64, glibc 2.36 as in both Debian 12 base images) is the
images' platform, so the check runs here and refuses any other interpreter.

Not modelled: packages a base image already holds (the Beam SDK image preinstalls Beam's
own pinned set); pip resolves the same requirements against them in the image.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / "build" / "image-check"
# pip warns once per package about index folders this machine's pip.conf names but lacks.
_PIP_NOISE = "is ignored: it is neither a file nor a directory"
_ENV = {"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONNOUSERSITE": "1"}


class CheckError(Exception):
    """One image failed a check; the message names the input and what to change."""


@dataclasses.dataclass(frozen=True, slots=True)
class Dockerfile:
    """What the check needs from one Dockerfile."""

    path: Path
    base_image: str
    python: str  # "3.11", from the base image's name
    pip_args: list[str]  # the `pip install` arguments, ARG defaults substituted
    build_checks: list[str]  # the code of each `python -c` after the install


@dataclasses.dataclass(frozen=True, slots=True)
class Image:
    """One image: its Dockerfile, the components it runs and the stage entry points."""

    name: str
    dockerfile: str  # relative to the repository root
    stages: tuple[str, ...]  # components.<stage> with a __main__
    data_role: bool  # runs pipelines.dag.kfp_components.DATA_COMPONENTS (else every other one)
    modules: tuple[str, ...]  # further modules its processes import


IMAGES = {
    "train": Image(
        name="train",
        dockerfile="containers/Dockerfile.train",
        stages=("sft", "reward", "ppo", "dpo", "evaluate"),
        data_role=False,
        # The KFP executor, the CLI (the image's entry point), the smoke task, and the JobSet
        # launcher a multi-host GKE training task runs on this image.
        modules=(
            "kfp.dsl.executor_main",
            "pipelines.cli.main",
            "pipelines.targets.smoke_task",
            "pipelines.targets.gke.launcher",
        ),
    ),
    "data": Image(
        name="data",
        dockerfile="containers/Dockerfile.data",
        stages=("shard",),
        data_role=True,
        # The Dataflow worker harness (what the Beam image's boot starts), GCS IO and the
        # Dataflow runner the shard task submits with.
        modules=(
            "kfp.dsl.executor_main",
            "apache_beam.runners.worker.sdk_worker_main",
            "apache_beam.io.gcp.gcsio",
            "apache_beam.runners.dataflow.dataflow_runner",
        ),
    ),
}


# --- Reading a Dockerfile ----------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments gone."""
    found, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        current += " " + stripped.removesuffix("\\") if current else stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
            current = ""
    return found


def _expand(text: str, args: dict[str, str], path: Path) -> str:
    """``text`` with ``${NAME}`` and ``$NAME`` replaced by the ARG defaults."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in args:
            raise CheckError(
                f"{path}: ${name} has no ARG {name}=DEFAULT before it; give it a default so "
                "the image's requirements are fixed by the Dockerfile"
            )
        return args[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def _commands(run: str) -> list[list[str]]:
    """The shell commands of one RUN, split on ``&&``."""
    commands, current = [], []
    for token in shlex.split(run):
        if token == "&&":
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [*commands, current]


def _pip_install_args(command: list[str]) -> list[str] | None:
    """The arguments of ``pip install ...`` / ``python -m pip install ...``, else None."""
    for prefix in (["pip", "install"], ["pip3", "install"], ["python", "-m", "pip", "install"]):
        if command[: len(prefix)] == prefix:
            return command[len(prefix) :]
    return None


def parse_dockerfile(path: Path) -> Dockerfile:
    """The base image, its Python, and the one ``pip install`` of ``path``."""
    args: dict[str, str] = {}
    base, installs, checks = "", [], []
    for word, rest in _instructions(path.read_text()):
        if word == "ARG":
            name, sep, default = rest.partition("=")
            if sep:
                args[name.strip()] = default.strip().strip("\"'")
        elif word == "FROM":
            base = _expand(rest.split()[0], args, path)
        elif word == "RUN":
            for command in _commands(_expand(rest, args, path)):
                pip_args = _pip_install_args(command)
                if pip_args is not None:
                    installs.append(pip_args)
                elif command[:2] in (["python", "-c"], ["python3", "-c"]):
                    checks.append(command[2])
    if not base:
        raise CheckError(f"{path}: no FROM line")
    if len(installs) != 1:
        raise CheckError(
            f"{path}: {len(installs)} `pip install` commands; the check resolves one requirement "
            "set per image, so install everything in one `pip install`"
        )
    python = re.search(r"python[:_-]?(3\.\d+)", base)
    if python is None:
        raise CheckError(f"{path}: base image {base} does not name its Python (python:3.11-...)")
    return Dockerfile(path, base, python.group(1), installs[0], checks)


# --- What the image's processes import ----------------------------------------------------


def _body_imports(function: object) -> list[str]:
    """``module`` or ``module:name`` for each import statement in ``function``'s body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [f"{node.module}:{alias.name}" for alias in node.names]
    return found


def import_targets(image: Image) -> list[str]:
    """Every module (``module`` or ``module:name``) one of ``image``'s tasks imports."""
    sys.path.insert(0, str(ROOT))
    from pipelines.dag import kfp_components

    names = [
        name
        for name in kfp_components.Components._fields
        if (name in kfp_components.DATA_COMPONENTS) == image.data_role
    ]
    targets = [t for name in names for t in _body_imports(kfp_components.component_function(name))]
    targets += [f"components.{stage}.stage" for stage in image.stages]
    return sorted({*targets, *image.modules})


# The import check, run by the image venv's Python from outside the work tree.
_IMPORT_CHECK = """
import importlib, json, sys
failed = {}
for target in json.loads(sys.argv[1]):
    module, _, name = target.partition(":")
    try:
        loaded = importlib.import_module(module)
        if name and not hasattr(loaded, name):
            importlib.import_module(module + "." + name)
    except Exception as error:
        failed[target] = f"{type(error).__name__}: {error}"
print(json.dumps(failed))
"""
_SMOKE_CHECK = "from pipelines.targets.smoke_task import check_devices; check_devices('cpu', 8)"


# --- pip and venvs ------------------------------------------------------------------------


def _run(command: list[str], cwd: Path = ROOT, env: dict | None = None) -> tuple[int, str]:
    """Run ``command``; its exit status and output (stdout + stderr, pip's noise dropped)."""
    # One stream, in order: pip explains a conflict on stdout between its ERROR lines.
    done = subprocess.run(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )  # fmt: skip
    lines = done.stdout.splitlines()
    return done.returncode, "\n".join(x for x in lines if _PIP_NOISE not in x)


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _venv(python: str, folder: Path, upgrade_pip: bool = False) -> Path:
    """A venv of ``python`` at ``folder`` (made once); its Python."""
    bin_python = folder / "bin" / "python"
    if not bin_python.exists():
        command = [python, "-m", "venv", *(["--upgrade-deps"] if upgrade_pip else []), str(folder)]
        code, output = _run(command)
        if code:
            raise CheckError(f"{python} -m venv {folder} failed:\n{output[-2000:]}")
    return bin_python


def interpreter(python: str) -> dict:
    """Version, implementation and platform of ``python``."""
    if not shutil.which(python):
        raise CheckError(
            f"--python {python}: not found; install CPython 3.11 with venv "
            "(apt-get install python3.11-venv) or pass IMAGE_PYTHON=/path/to/python3.11"
        )
    code = (
        "import json, platform, sys, sysconfig; print(json.dumps({'version': "
        "'%d.%d' % sys.version_info[:2], 'impl': sys.implementation.name, "
        "'platform': sysconfig.get_platform(), 'full': platform.python_version()}))"
    )
    status, output = _run([python, "-c", code])
    if status:
        raise CheckError(f"--python {python} does not run:\n{output}")
    return json.loads(output.splitlines()[-1])


def conflict(output: str) -> str:
    """pip's explanation of a failed resolution: the packages and requirements that clash."""
    keep, started = [], False
    for line in output.splitlines():
        started = started or line.startswith("ERROR:")
        if line.startswith("To fix this you could try"):
            started = False
        if not started or "Ignored the following" in line or not line.strip():
            continue
        keep.append(re.sub(r"\(from versions: ([^)]{60})[^)]*\)", r"(from versions: \1...)", line))
    return "\n".join(keep) or output[-3000:]


def resolve(dockerfile: Dockerfile, resolver: Path, report: Path) -> list[dict]:
    """The packages pip installs for the Dockerfile's requirements (its --report entries)."""
    command = [str(resolver), "-m", "pip", "install", "--dry-run", "--ignore-installed"]
    command += ["--progress-bar", "off", "--report", str(report), *dockerfile.pip_args]
    code, output = _run(command)
    if code:
        raise CheckError(
            f"{_shown(dockerfile.path)}: its requirement set "
            f"({' '.join(dockerfile.pip_args)}) does not resolve for CPython "
            f"{dockerfile.python}:\n{textwrap.indent(conflict(output), '  ')}\nChange the pins "
            "of that `pip install` line, or the project's dependencies in pyproject.toml, "
            "so these agree"
        )
    return json.loads(report.read_text())["install"]


def pins(installed: list[dict]) -> list[str]:
    """``name==version`` of every resolved package but the local project, sorted."""
    return sorted(
        f"{item['metadata']['name']}=={item['metadata']['version']}"
        for item in installed
        if "dir_info" not in item.get("download_info", {})
    )


def image_venv(name: str, python: str, info: dict, pinned: list[str], cache: Path) -> Path:
    """The venv holding exactly ``pinned`` (reused when the set is unchanged); its Python."""
    key = hashlib.sha256("\n".join([info["full"], info["platform"], *pinned]).encode())
    folder = cache / f"{name}-{key.hexdigest()[:12]}"
    if (folder / ".complete").exists():
        print(f"  venv {_shown(folder)} (cached: same requirement set)")
        return folder / "bin" / "python"
    for stale in cache.glob(f"{name}-*"):
        if stale.is_dir():
            shutil.rmtree(stale)
    print(f"  installing {len(pinned)} packages into {_shown(folder)} ...")
    bin_python = _venv(python, folder)
    requirements = folder / "requirements.txt"
    requirements.write_text("\n".join(pinned) + "\n")
    command = [str(bin_python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(requirements)]
    code, output = _run(command)
    if code:
        raise CheckError(f"{name}: installing the resolved set failed:\n{output[-3000:]}")
    (folder / ".complete").write_text("\n".join(pinned) + "\n")
    return bin_python


def install_project(name: str, bin_python: Path) -> None:
    """Install the work tree's project as the image does (``pip install .``), then pip check."""
    command = [str(bin_python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall"]
    code, output = _run([*command, "."])
    if code:
        raise CheckError(f"{name}: `pip install .` of the work tree failed:\n{output[-3000:]}")
    code, output = _run([str(bin_python), "-m", "pip", "check"])
    if code:
        raise CheckError(f"{name}: pip check finds broken requirements:\n{output}")


# --- The checks inside an image's venv ----------------------------------------------------


def check_imports(image: Image, dockerfile: Dockerfile, bin_python: Path, cache: Path) -> None:
    """Import what the image's tasks import, run its stages' --help and the Dockerfile's check,
    all from outside the work tree (so the installed project is what imports)."""
    env = {**os.environ, **_ENV, "ALIGNPIPE_CPU_DEVICES": "8"}
    env.pop("PYTHONPATH", None)
    targets = import_targets(image)
    code, output = _run([str(bin_python), "-c", _IMPORT_CHECK, json.dumps(targets)], cache, env)
    failed = json.loads(output.splitlines()[-1]) if code == 0 else {"import check": output}
    for stage in image.stages:
        code, output = _run([str(bin_python), "-m", f"components.{stage}", "--help"], cache, env)
        if code:
            failed[f"python -m components.{stage} --help"] = output[-1500:]
    for check in dockerfile.build_checks + ([_SMOKE_CHECK] if not image.data_role else []):
        code, output = _run([str(bin_python), "-c", check], cache, env)
        if code:
            failed[f"python -c {check!r}"] = output[-1500:]
    if failed:
        lines = "\n".join(f"  {target}: {error}" for target, error in failed.items())
        raise CheckError(
            f"{image.name}: with the resolved set installed, these fail:\n{lines}\n"
            "Add the missing package to the Dockerfile's `pip install` line or to pyproject's "
            "dependencies (or fix the import)"
        )
    smoke = "" if image.data_role else "; the smoke task's pmap step runs (8 CPU devices)"
    print(
        f"  {len(targets)} modules import; {len(image.stages)} stage entry points answer "
        f"--help; the Dockerfile's own check passes{smoke}"
    )


def check_beam_version(dockerfile: Dockerfile, installed: list[dict]) -> None:
    """A Beam SDK image's workers run its own Beam: the image must not install another."""
    base = re.search(r"beam_python[\d.]+_sdk:(\d+\.\d+\.\d+)", dockerfile.base_image)
    if base is None:
        return
    resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installed}
    beam = resolved.get("apache-beam")
    if beam != base.group(1):
        raise CheckError(
            f"{_shown(dockerfile.path)}: the base image {dockerfile.base_image} ships "
            f"Beam {base.group(1)} but the `pip install` resolves apache-beam {beam}; a Dataflow "
            "worker must run the job's SDK: pin apache-beam to the base image's version"
        )
    print(f"  apache-beam {beam} = the base image's Beam (Dataflow worker harness)")


def check_image(image: Image, python: str, info: dict, cache: Path) -> None:
    """Resolve, install and import-check one image; raises CheckError naming what failed."""
    dockerfile = parse_dockerfile(ROOT / image.dockerfile)
    print(f"{image.name}: {image.dockerfile} (FROM {dockerfile.base_image})")
    if dockerfile.python != info["version"]:
        raise CheckError(
            f"{image.dockerfile}: the base image {dockerfile.base_image} is Python "
            f"{dockerfile.python}, but --python {python} is {info['version']}; pass an "
            f"interpreter of Python {dockerfile.python} (make check-images IMAGE_PYTHON=...)"
        )
    resolver = _venv(python, cache / f"resolver-{info['version']}", upgrade_pip=True)
    installed = resolve(dockerfile, resolver, cache / f"{image.name}-report.json")
    pinned = pins(installed)
    versions = {p.split("==")[0].lower(): p.split("==")[1] for p in pinned}
    shown = [f"{n} {versions[n]}" for n in ("jax", "libtpu", "apache-beam", "kfp") if n in versions]
    print(f"  resolves for CPython {info['full']}: {len(pinned)} packages ({', '.join(shown)})")
    (cache / f"{image.name}-requirements.txt").write_text("\n".join(pinned) + "\n")
    check_beam_version(dockerfile, installed)
    bin_python = image_venv(image.name, python, info, pinned, cache)
    install_project(image.name, bin_python)
    check_imports(image, dockerfile, bin_python, cache)


def main(argv: list[str] | None = None) -> int:
    """Check the images named (default: all); 1 when any fails, each failure explained."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", action="append", choices=sorted(IMAGES), help="(repeat)")
    parser.add_argument("--python", default="/usr/bin/python3.11", help="the images' Python")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="venvs go here")
    args = parser.parse_args(argv)
    failures = []
    try:
        info = interpreter(args.python)
        if info["impl"] != "cpython" or info["platform"] != "linux-x86_64":
            raise CheckError(
                f"--python {args.python} is {info['impl']} on {info['platform']}; the images "
                "are CPython on linux-x86_64 and the check resolves natively: run it there"
            )
    except CheckError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    args.cache.mkdir(parents=True, exist_ok=True)
    for name in args.image or list(IMAGES):
        try:
            check_image(IMAGES[name], args.python, info, args.cache.resolve())
            print(f"{name}: ok")
        except CheckError as error:
            failures.append(name)
            print(f"error: {error}", file=sys.stderr)
    if failures:
        print(f"images that fail: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
