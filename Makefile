# hf-sanity developer targets. Everything runs inside ./.venv, created on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

LINT_PATHS := $(wildcard hf_sanity tests recipes benchmarks)

.PHONY: install demo test test-fast lint format docs bench clean

install: $(STAMP)

# The stamp depends on pyproject.toml: `make install` is a no-op until the dependencies change.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	$(BIN)/hf-sanity demo

test: install
	$(BIN)/python -m pytest

# The developer's lane: in-process tests only (no subprocess, torchrun, recipe or browser run).
test-fast: install
	$(BIN)/python -m pytest -m "not slow"

lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: install
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

docs: install
	$(BIN)/python -m hf_sanity.docs docs/rules.md
	$(BIN)/python -m hf_sanity.docs docs/report.schema.json

bench: install
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
