# The two commands a fresh machine needs (see README): `make demo` and `make test`.
# `make test-fast` is the quick loop for changes that do not touch serving: no vLLM engine, no slow test.
VENV ?= .venv
export SLIMWISE_VENV := $(VENV)

.PHONY: setup demo test test-fast test-matrix lint
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/slimwise demo

test: setup
	$(VENV)/bin/ruff check slimwise tests scripts experiments
	$(VENV)/bin/python -m pytest -q -ra --durations=30

test-fast: setup
	$(VENV)/bin/ruff check slimwise tests scripts experiments
	$(VENV)/bin/python -m pytest -q -ra -m "not vllm and not slow" --durations=10

# what CI leaves out to stay under 30 minutes on the slowest 2-core VM: the served-client cross-product beyond
# CI's slice, compiled repeats of paths CI runs eager, and the full card re-evaluation of every backbone but one
test-matrix: setup
	$(VENV)/bin/python -m pytest -q -ra -m matrix --durations=10

lint:
	$(VENV)/bin/ruff check slimwise tests scripts experiments
