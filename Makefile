# alignpipe — `make help` lists the targets.
SHELL := bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
# pytest-xdist workers; each module stays on one worker (its fixtures compile once), the
# long ones start first (tests/conftest.py).
TEST_WORKERS ?= 2
VENV ?= .venv
BIN := $(VENV)/bin
# pip prints one warning per package for index folders this machine lacks; keep the log
# readable. sed (unlike grep) exits 0 on empty output, so pipefail still reports pip's failure.
PIP_QUIET := sed '/is ignored: it is neither a file nor a directory/d'

.PHONY: help install demo test test-all test-durations lint format bench clean

help: ## Show this help.
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-15s\033[0m %s\n", $$1, $$2}'

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 2>&1 | $(PIP_QUIET)
	$(BIN)/pip install -q -e '.[test]' 2>&1 | $(PIP_QUIET)
	$(BIN)/python -c "import components, pipelines, jax, apache_beam, tensorflow"
	touch $@

install: $(BIN)/.installed ## Create .venv and install alignpipe with its test tools.

demo: install ## Run the whole pipeline locally on the built-in task (CPU).
	$(BIN)/python -m pipelines.demo

# `make test` is the suite without the tests marked `slow`: the end-to-end runs, and the
# checks the suite makes once repeated at other shapes, families and variants (pyproject.toml's
# marker). `make test-all` runs those too. A test whose worker crashed (XLA:CPU's compiler
# segfaulted in a long-lived worker about once a run, 2026-12-05, until tests/conftest.py freed
# each module's programs) runs again alone when such tests are the only failures
# (tests/rerun_crashed.py).
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install ## Run the test suite without the slow tier (CPU, 8 virtual devices; 2 workers).
	$(PYTEST) -m "not slow" tests || $(BIN)/python tests/rerun_crashed.py

test-all: install ## Run every test, the slow tier's end-to-end runs and repeats included.
	$(PYTEST) tests || $(BIN)/python tests/rerun_crashed.py

# Each run records its test modules' times in pytest's cache (a module's slow tests apart);
# `make test` and `make test-all` order the modules by them, and by this file on a fresh clone
# (tests/conftest.py).
test-durations: ## Copy the last run's recorded module times to tests/module_durations.json.
	$(BIN)/python -m json.tool --sort-keys .pytest_cache/v/alignpipe/module_durations tests/module_durations.json

lint: install ## Check style with ruff.
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install ## Format the code with ruff.
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install ## Run every benchmark (prints figures and ratios; ~100 min; installs the [bench] extra for TRL).
	$(BIN)/pip install -q -e '.[bench]' 2>&1 | $(PIP_QUIET)
	$(BIN)/python benchmarks/bench_shard.py
	$(BIN)/python benchmarks/bench_remat.py
	$(BIN)/python benchmarks/bench_pmap.py
	$(BIN)/python benchmarks/bench_sampler.py
	$(BIN)/python benchmarks/bench_ppo.py
	$(BIN)/python benchmarks/bench_ppo_memory.py
	$(BIN)/python benchmarks/bench_algorithms.py --json build/bench_algorithms.json
	$(BIN)/python benchmarks/bench_libraries.py
	$(BIN)/python benchmarks/bench_verifiable.py --json build/bench_verifiable.json
	$(BIN)/python benchmarks/bench_overoptimisation.py --json build/bench_overoptimisation.json

clean: ## Remove the virtual environment, caches and local runs.
	rm -rf $(VENV) runs .pytest_cache .ruff_cache build *.egg-info

# Images and cloud pipeline specs (see containers/ and `alignpipe compile --help`).
REGISTRY ?= us-central1-docker.pkg.dev/PROJECT/alignpipe
# The commit, marked -dirty when the work tree has changes: a tag names one content.
TAG ?= $(shell git describe --always --dirty --abbrev=12 2>/dev/null || echo dev)
TRAIN_IMAGE ?= $(REGISTRY)/train:$(TAG)
DATA_IMAGE ?= $(REGISTRY)/data:$(TAG)
# `make push` records the pushed digests here; `make compile` binds them. Pipelines cache
# tasks by image reference, so a digest (immutable) is the reference to compile with.
IMAGES_ENV := build/images.env
-include $(IMAGES_ENV)

.PHONY: images push compile

images: ## Build the training (JAX TPU) and data (Beam) images: REGISTRY=… TAG=…
	DOCKER_BUILDKIT=1 docker build -f containers/Dockerfile.train -t $(TRAIN_IMAGE) .
	DOCKER_BUILDKIT=1 docker build -f containers/Dockerfile.data -t $(DATA_IMAGE) .

push: ## Push both images to $(REGISTRY); writes their digests to build/images.env.
	docker push $(TRAIN_IMAGE)
	docker push $(DATA_IMAGE)
	mkdir -p build
	{ echo "TRAIN_DIGEST := $$(docker inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' $(TRAIN_IMAGE) | grep -m1 '^$(REGISTRY)/train@sha256:')"; \
	  echo "DATA_DIGEST := $$(docker inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' $(DATA_IMAGE) | grep -m1 '^$(REGISTRY)/data@sha256:')"; \
	} > $(IMAGES_ENV)
	cat $(IMAGES_ENV)

compile: install ## Write build/pipeline-vertex.yaml and -gke.yaml, bound to the pushed digests.
	@test -n "$(TRAIN_DIGEST)" || echo "note: no $(IMAGES_ENV) (make push): compiling with the tag $(TRAIN_IMAGE)"
	$(BIN)/alignpipe compile --target vertex --image $(or $(TRAIN_DIGEST),$(TRAIN_IMAGE)) --data-image $(or $(DATA_DIGEST),$(DATA_IMAGE)) -o build/pipeline-vertex.yaml
	$(BIN)/alignpipe compile --target gke --image $(or $(TRAIN_DIGEST),$(TRAIN_IMAGE)) --data-image $(or $(DATA_DIGEST),$(DATA_IMAGE)) -o build/pipeline-gke.yaml

# Each image's Python dependency set, checked on this machine without Docker: resolved by
# pip for the images' CPython 3.11, installed into a venv under build/image-check (reused
# while the resolved set is unchanged) and the stage entry points imported from it.
# Downloads packages, so it is not part of `make test`.
IMAGE_PYTHON ?= /usr/bin/python3.11

.PHONY: check-images

check-images: install ## Resolve each image's pip set for Python 3.11 and import its entry points (no Docker).
	$(BIN)/python containers/check_images.py --python $(IMAGE_PYTHON)
