# imq: two commands on a fresh machine with Python 3.11 and make.
#   make run   creates .venv, installs, runs the main job on an embedded default database
#   make test  creates .venv if needed, installs, runs ruff, mypy --strict and pytest
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# setuptools warns at every editable install of a package beside its pyproject.toml that
# a folder of the package's name may take precedence in imports: that folder is imq
# itself, so the twelve lines of warning told a newcomer nothing.
PIP    := PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip

.PHONY: run test lint typecheck pytest soak bench bench-endurance clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml setup.py imq/_speedups.c
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

# The picture needs matplotlib (the plot extra): installed once, on the first run.
run: $(STAMP)
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(PIP) install --quiet -e '.[dev,plot]'
	$(BIN)/python -m imq simulate --fresh

lint: $(STAMP)
	$(BIN)/ruff check imq tests benchmarks
	$(BIN)/ruff format --check imq tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict imq

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

soak: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(PIP) install --quiet -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.bench_core
	$(BIN)/python -m benchmarks.bench_gc
	$(BIN)/python -m benchmarks.bench_gc_pause
	$(BIN)/python -m benchmarks.bench_state
	$(BIN)/python -m benchmarks.bench_floor
	$(BIN)/python -m benchmarks.bench_peers
	$(BIN)/python -m benchmarks.bench_scaling
	$(BIN)/python -m benchmarks.bench_sim --profile --out benchmarks/results/sim.md

# The steady state (issue 11): a 10-minute warm-up, then 30 minutes measured (about 40
# minutes), apart from `make bench` for its length.
bench-endurance: $(STAMP)
	$(PIP) install --quiet -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.bench_endurance

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .hypothesis var
