# Two commands set up a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-heavy lint format unit dist e2e clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: pip then takes the CPU wheel, not a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshrun demo

# Two test files at a time (pytest-xdist, one file per worker): most tests wait on launches,
# rendezvous and timeouts more than they compute, so two keep 2 cores busier; TEST_WORKERS=0
# runs them one by one. Tests are safe side by side: free ports, namespaces and SLURM
# clusters named per test.
TEST_WORKERS ?= 2
# Each run keeps its cost: the slowest tests, each tier's total against its budget
# (tests/conftest.py), every test's time (test-results/durations.json) and a JUnit XML.
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: without it every launched
# process compiled meshrun's modules again, and each test worker rewrote every test module's
# asserts (collecting the suite took 22 s instead of 16 s here).
PYTEST := env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 \
	MESHRUN_DURATIONS_FILE=test-results/durations.json \
	$(BIN)/python -m pytest -q --durations=30 --junitxml=test-results/junit.xml \
	-n $(TEST_WORKERS) --dist loadfile -m "not alone"
# Measurements of a link's rate (@pytest.mark.alone) run after the rest, one at a time: beside
# another worker's multi-process tests the kernel's shared network work slowed a 100 Mb/s
# measurement to 88 Mb/s, while alone (even beside busy CPU loops) it reads 93-99.
# Only the files that mark such tests are collected: collecting the whole suite took 22 s here.
ALONE_FILES = $(shell grep -rl --include='test_*.py' 'mark.alone' tests)
PYTEST_ALONE := env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 \
	MESHRUN_DURATIONS_FILE=test-results/durations-alone.json \
	$(BIN)/python -m pytest -q --junitxml=test-results/junit-alone.xml -n 0 -m alone

test: $(STAMP) lint
	$(PYTEST) tests
	$(PYTEST_ALONE) $(ALONE_FILES)

# CI's suite plus the heavy variants (@pytest.mark.heavy: larger meshes, second spellings).
test-heavy: $(STAMP) lint
	MESHRUN_HEAVY_TESTS=1 $(PYTEST) tests
	MESHRUN_HEAVY_TESTS=1 $(PYTEST_ALONE) $(ALONE_FILES)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests examples benchmarks
	$(BIN)/ruff check --fix src tests examples benchmarks

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

dist: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/dist

e2e: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/e2e

clean:
	rm -rf $(VENV) runs test-results .pytest_cache .mypy_cache .ruff_cache
