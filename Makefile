# The two commands a fresh machine needs (see README): `make demo` and `make test`.
VENV ?= .venv
export SLIMWISE_VENV := $(VENV)

.PHONY: setup demo test lint
setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/slimwise demo

test: setup
	$(VENV)/bin/ruff check slimwise tests scripts experiments
	$(VENV)/bin/python -m pytest -q -ra --durations=30

lint:
	$(VENV)/bin/ruff check slimwise tests scripts experiments
