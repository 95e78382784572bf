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

# the served-client cross-product beyond CI's slice (tests/test_vllm_clients.py: 30 vLLM instances, ~19 min)
test-matrix: setup
	$(VENV)/bin/python -m pytest -q -ra -m matrix --durations=10 tests/test_vllm_clients.py tests/test_vllm_serve.py

lint:
	$(VENV)/bin/ruff check slimwise tests scripts experiments
