# The worker image. Two stages: the first builds a virtualenv from the pinned
# constraints, the second copies only that virtualenv onto a clean slim base, so
# neither pip's build files nor the sources end up in the image that runs.
#
#   docker build -t kafka-triton-worker:0.1.0 .
#   docker run --rm kafka-triton-worker:0.1.0 check     # or: run (the default)
#
# The image has what every documented mode needs: both Kafka clients (aiokafka, and
# librdkafka for WORKER_KAFKA_CLIENT=confluent), OpenTelemetry tracing, YAML mapping files
# and the Schema Registry formats (Avro, JSON Schema).
#
# PYTHON_IMAGE names the base (any Debian-based image with python3 and its venv module).
# pip reaches PyPI from inside the build, or whatever index the base image's pip
# settings name (PIP_INDEX_URL, or PIP_NO_INDEX with PIP_FIND_LINKS): that is how the
# compose test builds it where no registry is reachable (deploy/compose-test/python).

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first, from the same constraints file as development and CI, so
# that a change to the worker's code does not reinstall them.
COPY constraints.txt pyproject.toml README.md ./
COPY worker ./worker
RUN pip install -c constraints.txt ".[confluent,otel,yaml,registry]" && pip check

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
# A fixed numeric uid, so Kubernetes `runAsNonRoot` can verify it without a passwd lookup.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin worker
USER 10001
WORKDIR /tmp
EXPOSE 9400
# /healthz answers while the process lives; readiness (/readyz) is for orchestrators.
# Python's urllib: the slim image has no curl. WORKER_METRICS_PORT moves the port.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('WORKER_METRICS_PORT', '9400'), timeout=2)"]
# exec form: the worker is PID 1 and receives SIGTERM itself, so it drains before exiting.
ENTRYPOINT ["kafka-triton-worker"]
CMD ["run"]
