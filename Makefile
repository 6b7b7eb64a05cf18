# Two commands for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all parity lint setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

## Train the small preset on the embedded corpus on CPU (4-8 minutes on 2 cores), always
## from step 0 (--fresh replaces an earlier demo run and its checkpoints).
demo: $(STAMP)
	$(BIN)/fivefold train configs/small-cpu.toml --fresh

## The CI suite: lint, then every test not marked slow.
test: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/pytest -q -m "not slow" --timeout 900 --durations=30

## Everything, including the full multi-rank parity matrix.
test-all: $(STAMP)
	$(BIN)/pytest -q --timeout 1800

## The multi-rank parity matrix and every checkpoint test (resharding, elastic restart).
parity: $(STAMP)
	$(BIN)/pytest -q tests/parallel tests/checkpoint --timeout 1800

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/ruff format --check src tests scripts benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
