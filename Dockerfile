# The worker image: slim Python, dependencies from the pinned constraints, non-root.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY pyproject.toml constraints.txt README.md ./
COPY worker ./worker
RUN pip install -c constraints.txt . && useradd --uid 10001 --no-create-home worker

USER worker
EXPOSE 9400
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/healthz', timeout=2)"
ENTRYPOINT ["kafka-triton-worker"]
CMD ["run"]
