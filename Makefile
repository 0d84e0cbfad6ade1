# The two commands of the README: `make demo` (train the embedded default) and `make test` (the test suite).
# Each one sets up .venv first (idempotent; see scripts/setup_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# DeepSpeed's compiled CPU ops: inside the environment, where scripts/setup_env.sh compiled them (see there why)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: env demo test test-fast lint bench plan clean

env:
	@bash scripts/setup_env.sh

# TORCH_CPP_LOG_LEVEL=ERROR: vLLM's CPU worker binds memory to NUMA node 0 and torch's C++ layer says so with a
# warning on every start; nothing to act on in the demo (real errors still print). --quiet: a mistake in the
# options is the recipe's one-line message, without accelerate's own traceback of the failed subprocess.
demo: env
	TORCH_CPP_LOG_LEVEL=ERROR $(VENV)/bin/accelerate launch --quiet --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no --cpu \
		--num_cpu_threads_per_process $(shell nproc) recipes/grpo.py $(ARGS)

# --junitxml: every test's duration (setup, call and teardown), kept in runs/tests/junit.xml after the run (CI's record
# of the slowest tests; the 30 slowest are also printed, pyproject.toml's addopts)
test: env
	$(PY) -m pytest -q --junitxml=runs/tests/junit.xml $(ARGS)

# the developer's loop: tests that start no process, engine or training run (tests/conftest.py marks them)
test-fast: env
	$(PY) -m pytest -q -m fast $(ARGS)

lint: env
	$(VENV)/bin/ruff check trl_nrollout tests recipes benchmarks

bench: env
	$(PY) benchmarks/run_all.py $(ARGS)

plan: env
	$(VENV)/bin/trl-nrollout plan $(ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
