# Developer entry points. `make test` and `make bench` install the package first only when it, torch or
# the CuTe DSL (cutlass) cannot be imported, so they also run where nothing can be installed.

PYTHON ?= python3
ARGS ?=

.PHONY: install deps test bench lint

install:
	$(PYTHON) -m pip install -e '.[dev]'

deps:
	@$(PYTHON) -c "import torch, cutlass, q8kv8" 2>/dev/null || { echo "Installing q8kv8 and its dependencies"; $(MAKE) --no-print-directory install; }

test: deps
	$(PYTHON) -m pytest -q -ra tests

bench: deps
	$(PYTHON) -m scripts.bench $(ARGS)

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
