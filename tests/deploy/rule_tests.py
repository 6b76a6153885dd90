"""promtool unit tests of the alert rules and the dashboard's "Workers up", as data.

Worker targets under the job names of the usual setups: the Prometheus Operator's
(``namespace/servicemonitor``) and annotation-based pod scraping (``kubernetes-pods``,
which also scrapes pods that are not workers). Nothing here is named ``worker``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "worker.json"

_PODS = "kubernetes-pods"
_OPERATOR = "monitoring/kafka-triton-worker"
_DOWN = "10.1.2.3:9400"  # a worker that stops answering at minute 3
_UP = "10.1.2.4:9400"  # a worker that keeps answering
_OTHER = "10.1.2.9:8080"  # some other pod, never a worker, always down


def workers_up_expr() -> str:
    """The PromQL of the dashboard's "Workers up" panel."""
    doc = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in doc["panels"] if p.get("title") == "Workers up"]
    (target,) = panel["targets"]
    return str(target["expr"])


def _series(name: str, job: str, instance: str, values: str, **labels: str) -> dict[str, str]:
    pairs = {"job": job, "instance": instance, **labels}
    inner = ", ".join(f'{k}="{v}"' for k, v in pairs.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _down_alert(job: str, instance: str) -> dict[str, Any]:
    return {
        "exp_labels": {"job": job, "instance": instance, "severity": "warning"},
        "exp_annotations": {
            "summary": f"Worker {instance} does not answer /metrics",
            "runbook_url": "DOCS_BASE_URL/runbook/#worker-down",
        },
    }


def rule_tests(workers_up: str) -> dict[str, Any]:
    """The promtool test file: one scenario per job naming, and one with no worker at all."""
    scenarios = []
    for job in (_PODS, _OPERATOR):
        scenarios.append(
            {
                "interval": "1m",
                "input_series": [
                    _series("up", job, _DOWN, "1 1 1 0 0 0 0 0"),
                    _series("worker_info", job, _DOWN, "1 1 1 _ _ _ _ _", version="0.1.0"),
                    _series("up", job, _UP, "1x7"),
                    _series("worker_info", job, _UP, "1x7", version="0.1.0"),
                    _series("up", _PODS, _OTHER, "0x7"),
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "7m",
                        "alertname": "WorkerDown",
                        "exp_alerts": [_down_alert(job, _DOWN)],
                    },
                    {"eval_time": "7m", "alertname": "WorkersAbsent", "exp_alerts": []},
                ],
                "promql_expr_test": [
                    {
                        "expr": workers_up,
                        "eval_time": "7m",
                        "exp_samples": [{"labels": "{}", "value": 1}],
                    },
                    {
                        "expr": workers_up,
                        "eval_time": "2m",
                        "exp_samples": [{"labels": "{}", "value": 2}],
                    },
                ],
            }
        )
    scenarios.append(
        {
            "interval": "1m",
            "input_series": [_series("up", _PODS, _OTHER, "1x10")],
            "alert_rule_test": [
                {
                    "eval_time": "6m",
                    "alertname": "WorkersAbsent",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "critical"},
                            "exp_annotations": {
                                "summary": "No worker is scraped; nothing consumes the requests",
                                "runbook_url": "DOCS_BASE_URL/runbook/#worker-down",
                            },
                        }
                    ],
                },
                {"eval_time": "6m", "alertname": "WorkerDown", "exp_alerts": []},
            ],
        }
    )
    return {
        "rule_files": ["/etc/prometheus/alerts.yml"],
        "evaluation_interval": "1m",
        "tests": scenarios,
    }
