# alignpipe — `make help` lists the targets.
SHELL := bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pip prints one warning per package for index folders this machine lacks; keep the log readable.
PIP_QUIET := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: help install demo test lint format bench clean

help: ## Show this help.
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 2>&1 | $(PIP_QUIET)
	$(BIN)/pip install -q -e '.[test]' 2>&1 | $(PIP_QUIET)
	$(BIN)/python -c "import components, pipelines, jax, apache_beam, tensorflow"
	touch $@

install: $(BIN)/.installed ## Create .venv and install alignpipe with its test tools.

demo: install ## Run the whole pipeline locally on the built-in task (CPU).
	$(BIN)/python -m pipelines.demo

test: install ## Run the test suite (CPU, 8 virtual devices).
	$(BIN)/python -m pytest -q tests

lint: install ## Check style with ruff.
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install ## Format the code with ruff.
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install ## Run the benchmarks (prints figures and ratios; minutes).
	$(BIN)/python benchmarks/bench_shard.py

clean: ## Remove the virtual environment, caches and local runs.
	rm -rf $(VENV) runs .pytest_cache .ruff_cache build *.egg-info
