"""Helpers shared by the tests, by side: Kafka, the models, the worker."""

from tests.support.kafka import (
    Collected,
    Streams,
    Topics,
    collect,
    collect_streams,
    create,
    headers_dict,
    local_kafka,
    read_all,
    request_id_of,
    send,
)
from tests.support.models import decode_sample, mlp_reference, result_outputs
from tests.support.worker import (
    COMMIT_SLACK_MS,
    report,
    results_published,
    rss_bytes,
    running_worker,
    settings_for,
    spawn_worker,
    wait_ready,
    worker_env,
)

__all__ = [
    "COMMIT_SLACK_MS",
    "Collected",
    "Streams",
    "Topics",
    "collect",
    "collect_streams",
    "create",
    "decode_sample",
    "headers_dict",
    "local_kafka",
    "mlp_reference",
    "read_all",
    "report",
    "request_id_of",
    "result_outputs",
    "results_published",
    "rss_bytes",
    "running_worker",
    "send",
    "settings_for",
    "spawn_worker",
    "wait_ready",
    "worker_env",
]
