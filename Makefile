# fedweave developer commands. `make setup` once, then `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# Per-test timeout (seconds) and parallelism for pytest.
PYTEST_TIMEOUT ?= 300
PYTEST_WORKERS ?= auto

.PHONY: setup test test-fast lint typecheck layers pytest bench clean

setup: $(BIN)/fedweave

$(BIN)/fedweave: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet "pip>=24"
	# torch first, pinned to 2.13: the CPU build lies on disk; an open range pulls a CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.*"
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

layers: setup
	$(BIN)/lint-imports

pytest: setup
	$(BIN)/pytest -n $(PYTEST_WORKERS) --maxschedchunk 2 --timeout $(PYTEST_TIMEOUT)

# Everything CI runs: lint, types, layering, and the whole test suite (e2e included).
test: lint typecheck layers pytest

# The same without the long end-to-end tests, for a quick local loop.
test-fast: lint typecheck layers
	$(BIN)/pytest -n $(PYTEST_WORKERS) --maxschedchunk 2 --timeout $(PYTEST_TIMEOUT) -m "not e2e"

bench: setup
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
