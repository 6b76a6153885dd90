"""The mapping check when Triton does not answer: nothing is judged, nothing refused."""

from __future__ import annotations

from pathlib import Path

from devtools.devstack.process import free_port
from worker.checks.mappings import inspect_mappings, mapping_rows
from worker.checks.startup import check_mappings
from worker.settings import Settings, load_settings

MAPPING = """
[topics.events]
model = "mlp"
[topics.events.inputs.INPUT0]
datatype = "FP32"
from = "/features"
shape = [64]
"""


def settings(tmp_path: Path, triton_url: str, mapping: bool = True) -> Settings:
    path = tmp_path / "mapping.toml"
    path.write_text(MAPPING)
    env = {
        "WORKER_INPUT_TOPICS": "events",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        "WORKER_TRITON_URL": triton_url,
    }
    if mapping:
        env["WORKER_MAPPING_FILE"] = str(path)
    return load_settings(env, [], isatty=False)


async def test_a_triton_that_does_not_answer_leaves_the_mapping_unjudged(tmp_path: Path) -> None:
    closed = settings(tmp_path, f"127.0.0.1:{free_port()}")
    findings = await inspect_mappings(closed, 5.0)
    assert findings is not None
    assert findings.unreachable is not None and findings.lines() == []
    assert [row.outcome for row in mapping_rows(findings)] == ["skip", "skip"]
    await check_mappings(closed, 5.0)  # passes: no refusal


async def test_no_mapping_file_asks_nothing(tmp_path: Path) -> None:
    plain = settings(tmp_path, "nowhere.invalid:1", mapping=False)
    assert await inspect_mappings(plain, 5.0) is None
    await check_mappings(plain, 5.0)
