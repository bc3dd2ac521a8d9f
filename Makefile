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

.PHONY: install demo test test-fast test-lower lint format docs bench clean

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

# The developer's lane: in-process tests only (no subprocess, torchrun, recipe, browser or long Trainer run), on
# WORKERS processes (pytest-xdist; one per core of this 2-core machine), each with its share of the cores as torch
# threads: two workers of two threads each on two cores made every small operation wait for a busy core (one
# test 3 s alone, 29 s in the lane; the lane 6m21s against 3m31s with one thread a worker).
# `make test` (CI) stays serial: its torchrun and subprocess runs share ports and cores.
WORKERS ?= 2
THREADS ?= $(shell $(PYTHON) -c 'import os; print(max(1, (os.cpu_count() or 1) // $(WORKERS)))')
WORKER_ENV = OMP_NUM_THREADS=$(THREADS) MKL_NUM_THREADS=$(THREADS)
test-fast: install
	$(WORKER_ENV) $(BIN)/python -m pytest -m "not slow" -n $(WORKERS)

# The lower lanes: the fast suite on the oldest versions supported, each in its own cached venv (the torch pin
# first). `llamafactory` (the default): LLaMA-Factory 0.9.5's upper pins, the lowest set of the supported
# ranges (pyproject); `axolotl`: Axolotl 0.19's pins. `make test-lower LOWER=axolotl`.
LOWER ?= llamafactory
LOWER_PINS_llamafactory := transformers==5.6.0 trl==0.24.0 peft==0.18.1 datasets==4.0.0 accelerate==1.11.0
LOWER_PINS_axolotl := transformers==5.16.1 trl==1.9.0 peft==0.20.0 datasets==4.8.4
LOWER_VENV := .venv-lower-$(LOWER)

$(LOWER_VENV)/.installed: pyproject.toml
	@test -n "$(LOWER_PINS_$(LOWER))" || { echo "LOWER must be llamafactory or axolotl, not $(LOWER)"; exit 2; }
	test -x $(LOWER_VENV)/bin/python || $(PYTHON) -m venv $(LOWER_VENV)
	$(LOWER_VENV)/bin/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(LOWER_VENV)/bin/python -m pip install -q "$(TORCH)")
	$(LOWER_VENV)/bin/python -m pip install -q -e ".[dev]" $(LOWER_PINS_$(LOWER))
	touch $@

test-lower: $(LOWER_VENV)/.installed
	$(WORKER_ENV) $(LOWER_VENV)/bin/python -m pytest -m "not slow" -n $(WORKERS)

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
	rm -rf $(VENV) .venv-lower-* build *.egg-info .pytest_cache .ruff_cache
