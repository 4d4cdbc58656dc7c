# Developer entry points. `make test` and `make bench` install the package first only when it, torch or
# the CuTe DSL (cutlass) cannot be imported, so they also run where nothing can be installed. That check
# builds nothing (Q8KV8_COMPILE_AT_IMPORT=0), so its stderr can stay quiet; the kernels are built (or
# loaded) by pytest or the benchmark, whose build lines reach the terminal.

PYTHON ?= python3
ARGS ?=

.PHONY: install deps test test-variants bench lint

install:
	$(PYTHON) -m pip install -e '.[dev]'

deps:
	@Q8KV8_COMPILE_AT_IMPORT=0 $(PYTHON) -c "import torch, cutlass, q8kv8" 2>/dev/null || { echo "Installing q8kv8 and its dependencies"; $(MAKE) --no-print-directory install; }

# `make test` runs the per-variant build checks (marked `variants`) on a representative subset of the kernel
# variants; `make test-variants` builds every variant in $(JOBS) processes (one a core), then runs those
# checks alone, on every variant (CI runs both).
JOBS ?= $(shell nproc 2>/dev/null || echo 1)

# `make test` spreads the tests over $(TEST_JOBS) pytest-xdist workers (one a core, at most 4) when
# pytest-xdist is installed (the dev extras), else runs them in one process.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$((n < 4 ? n : 4)))
TEST_WORKERS = $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(TEST_JOBS)")

test: deps
	$(PYTHON) -m pytest -q -ra $(TEST_WORKERS) tests

test-variants: deps
	Q8KV8_COMPILE_AT_IMPORT=0 $(PYTHON) -m q8kv8.compile --jobs $(JOBS)
	$(PYTHON) -m pytest -q -ra --all-variants -m variants tests

bench: deps
	$(PYTHON) -m scripts.bench $(ARGS)

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
