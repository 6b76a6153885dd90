# Two commands for a newcomer: `make demo` and `make test`. Everything they need
# (virtualenv, Python packages, Kafka jars, the Triton wheel) is installed here.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help tools venv fetch test unit lint demo bench dev-up dev-down clean

help:
	@echo "make demo   - start a local Kafka + Triton, run the worker end to end, print a summary"
	@echo "make test   - lint, type-check and run the whole test suite against real Kafka and Triton"
	@echo "make bench  - run the benchmark"

tools:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"' \
		|| { echo "error: Python 3.11+ is needed as '$(PYTHON)'"; exit 1; }
	@command -v java >/dev/null || { echo "error: Java 17+ is needed (java not found)"; exit 1; }
	@command -v mvn >/dev/null || { echo "error: Maven is needed (mvn not found)"; exit 1; }

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	@touch $(STAMP)

venv: tools $(STAMP)

fetch: venv
	$(PY) -m worker dev fetch

lint: venv
	$(PY) -m ruff check worker tests
	$(PY) -m ruff format --check worker tests
	$(PY) -m mypy

test: fetch lint
	$(PY) -m pytest $(PYTEST_ARGS)

unit: venv
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

demo: fetch
	$(PY) -m worker demo

bench: fetch
	$(PY) -m worker bench

dev-up: fetch
	$(PY) -m worker dev up

dev-down: venv
	$(PY) -m worker dev down

clean:
	-$(PY) -m worker dev down
	rm -rf $(VENV) .devstack .pytest_cache .mypy_cache .ruff_cache
