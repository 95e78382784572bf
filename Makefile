# The two commands a fresh machine needs (see README): `make demo` and `make test`.
# `make test-fast` is the quick loop for changes that do not touch serving: no vLLM engine, no slow test.
VENV ?= .venv
export SLIMWISE_VENV := $(VENV)

.PHONY: setup demo test test-fast test-matrix lint
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/slimwise demo

# The suite in two passes. The tests that start no vLLM engine run on two pytest-xdist workers of one thread
# each: the testbed models are small enough that a step is Python and dispatch, so two one-thread processes
# finish them sooner than one two-thread process, and one thread each keeps OpenMP from oversubscribing the
# cores. The vLLM tests then run one at a time: an engine takes both cores. Both passes always run; the
# target fails if either did.
XDIST := -n 2 --dist loadfile
test: setup
	$(VENV)/bin/ruff check slimwise tests scripts experiments lab
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -ra -m "not matrix and not vllm" $(XDIST) --durations=20; \
	  a=$$?; $(VENV)/bin/python -m pytest -q -ra -m "not matrix and vllm" --durations=20; b=$$?; \
	  exit $$(( a || b ))

test-fast: setup
	$(VENV)/bin/ruff check slimwise tests scripts experiments lab
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -ra -m "not matrix and not vllm and not slow" $(XDIST) \
	  --durations=10

# what CI leaves out to stay under 30 minutes on the slowest 2-core VM: the served-client cross-product beyond
# CI's slice, compiled repeats of paths CI runs eager, and the full card re-evaluation of every backbone but one
test-matrix: setup
	$(VENV)/bin/python -m pytest -q -ra -m matrix --durations=10

lint:
	$(VENV)/bin/ruff check slimwise tests scripts experiments lab
