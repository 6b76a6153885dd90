# Two commands for a newcomer: `make demo` and `make test`. Everything they need
# (virtualenvs, Python packages, Kafka jars, the Triton wheel) is installed here.
#
# `make test` runs the whole suite on the oldest supported Python (the default
# virtualenv, .venv) on aiokafka; the integration and fault tests on 3.12 with the
# workers on librdkafka (WORKER_TEST_KAFKA_CLIENT=confluent): each Kafka client runs
# every integration and fault test a worker's client takes part in (not those marked
# one_client). The newest (.venv-3.13) runs
# the unit, contract, dev stack and integration tests on aiokafka (the fault tests,
# two thirds of a pass's time, already ran on both clients). The deploy tests
# (tests/deploy: the image and the compose file really run, the Kubernetes
# manifests validated) run once, in the default pass; `make compose-test` runs the
# compose test alone.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Each pass ends with its slowest tests, to see where the time of `make test` goes.
DURATIONS := --durations=25
# Python versions beside the default one: the newest runs everything but the fault tests on
# aiokafka, the librdkafka ones the integration and fault tests on librdkafka, the unit ones
# unit tests.
FULL_PYTHONS ?= 3.13
CONFLUENT_PYTHONS ?= 3.12
UNIT_PYTHONS ?=

.PHONY: help tools deploy-tools venv fetch test test-one matrix unit lint docs compose-test demo bench dev-up dev-down clean

help:
	@echo "make demo      - start a local Kafka + Triton, run the worker end to end, print a summary"
	@echo "make test      - lint, type-check, the whole suite on Python 3.11 (aiokafka) and 3.12 (librdkafka), all but the fault tests on 3.13"
	@echo "make test-one  - lint, type-check and the whole suite on the default Python only"
	@echo "make compose-test - build and run docker-compose.yml on local stand-in images, check it"
	@echo "make bench     - run the benchmark"
	@echo "make docs      - build the documentation site into site/"

tools:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed"' \
		|| { echo "error: Python 3.11+ is needed as '$(PYTHON)'"; exit 1; }
	@command -v java >/dev/null || { echo "error: Java 17+ is needed (java not found)"; exit 1; }
	@command -v mvn >/dev/null || { echo "error: Maven is needed (mvn not found)"; exit 1; }

# The compose test's system tools, Debian packages installed when missing (as root):
# a Docker engine (docker.io), docker-compose 1.29, mmdebstrap for the stand-in images'
# base, and npm for Grafana's published dashboard types. No service is started by the install (a policy-rc.d says so while it
# runs): the test starts its own dockerd when none answers, and stops it by its pid.
DEPLOY_PACKAGES := dockerd:docker.io docker-compose:docker-compose mmdebstrap:mmdebstrap npm:npm

deploy-tools:
	@missing=""; for pair in $(DEPLOY_PACKAGES); do \
		command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (Debian packages, for the compose test)"; \
		guard=""; if [ ! -e /usr/sbin/policy-rc.d ]; then guard=/usr/sbin/policy-rc.d; \
			printf '#!/bin/sh\nexit 101\n' > $$guard && chmod +x $$guard; fi; \
		apt-get -q -o Acquire::Retries=5 update && \
		DEBIAN_FRONTEND=noninteractive apt-get -q -y -o Acquire::Retries=5 \
			install --no-install-recommends $$missing; \
		status=$$?; if [ -n "$$guard" ]; then rm -f $$guard; fi; exit $$status; \
	fi

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench,docs]'
	@touch $(STAMP)

venv: tools $(STAMP)

# .venv-X.Y: the same packages on Python X.Y, found on PATH or in pyenv.
.venv-%/.installed: pyproject.toml constraints.txt
	@found=$$(bash .ci/find-python $*) || exit 1; \
		test -x .venv-$*/bin/python || $$found -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q -c constraints.txt -e '.[test,bench,docs]'
	@touch $@

fetch: venv
	$(PY) -m devtools dev fetch

lint: venv
	$(PY) -m ruff check worker devtools tests
	$(PY) -m ruff format --check worker devtools tests
	$(PY) -m mypy
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The docs site, into site/: a broken link or anchor, or a page left out of the
# navigation, fails the build (--strict with mkdocs.yml's validation settings).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

test: test-one matrix

test-one: fetch lint deploy-tools
	$(PY) -m pytest $(DURATIONS) $(PYTEST_ARGS)

compose-test: venv deploy-tools
	$(PY) -m pytest -p no:cacheprovider tests/deploy/test_compose_up.py $(PYTEST_ARGS)

matrix: $(foreach v,$(FULL_PYTHONS) $(CONFLUENT_PYTHONS) $(UNIT_PYTHONS),.venv-$(v)/.installed)
	@for v in $(FULL_PYTHONS); do \
		echo "== Python $$v: the whole suite but tests/fault (run on both clients) and tests/deploy"; \
		.venv-$$v/bin/python -m devtools dev fetch && \
		.venv-$$v/bin/python -m pytest -p no:cacheprovider -m "not deploy and not fault" $(DURATIONS) $(PYTEST_ARGS) || exit 1; \
	done
	@for v in $(CONFLUENT_PYTHONS); do \
		echo "== Python $$v: the integration and fault tests, the workers on librdkafka"; \
		.venv-$$v/bin/python -m devtools dev fetch && \
		WORKER_TEST_KAFKA_CLIENT=confluent .venv-$$v/bin/python -m pytest -p no:cacheprovider \
			-m "not unit and not devtools and not deploy and not one_client" $(DURATIONS) $(PYTEST_ARGS) || exit 1; \
	done
	@for v in $(UNIT_PYTHONS); do \
		echo "== Python $$v: unit tests"; \
		.venv-$$v/bin/python -m pytest -p no:cacheprovider -m unit $(PYTEST_ARGS) || exit 1; \
	done

unit: venv
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

demo: fetch
	$(PY) -m devtools demo

bench: fetch
	$(PY) -m devtools bench

dev-up: fetch
	$(PY) -m devtools dev up

dev-down: venv
	$(PY) -m devtools dev down

clean:
	-$(PY) -m devtools dev down
	rm -rf $(VENV) .venv-* .devstack .pytest_cache .mypy_cache .ruff_cache site
