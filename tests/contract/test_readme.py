"""The README's reference tables and contents are the ones the code generates; it opens with
a quickstart."""

from __future__ import annotations

import re
from pathlib import Path

from devtools.readme import anchor, contents_markdown, exit_codes_markdown, headings
from worker.errors import ExitCode
from worker.observability import metrics_reference_markdown
from worker.settings import reference_table_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def _between(marker: str) -> str:
    text = README.read_text()
    found = re.search(rf"<!-- {marker}:start[^>]*-->\n(.*?)<!-- {marker}:end -->", text, re.S)
    assert found, f"README lacks the {marker} markers"
    return found.group(1).strip()


def test_settings_table_matches_the_settings_model() -> None:
    """Every setting, flag, default and meaning in the README comes from worker/config.py."""
    assert _between("settings-table") == reference_table_markdown().strip()


def test_metrics_table_matches_the_metrics() -> None:
    """Every metric in the README is one the worker exports, with its type and labels."""
    assert _between("metrics-table") == metrics_reference_markdown().strip()


def test_exit_code_table_matches_the_exit_codes() -> None:
    """Every ExitCode, its number and its documented meaning, and nothing else, in the README."""
    table = _between("exit-codes-table")
    assert table == exit_codes_markdown().strip()
    listed = [int(row.split("|")[1]) for row in table.splitlines()[2:]]
    assert listed == [int(code) for code in ExitCode]


def test_contents_list_every_section() -> None:
    """The contents link each ## section and its ### subsections, in the README's order."""
    text = README.read_text()
    assert _between("contents") == contents_markdown(text).strip()


def test_readme_opens_with_contents_then_a_quickstart_of_at_most_30_lines() -> None:
    """Contents first, then the quickstart: topics, check, run, one `double` request, tail."""
    text = README.read_text()
    sections = [title for level, title in headings(text) if level == 2]
    assert sections[:3] == ["Contents", "Quickstart: your Kafka, your Triton", "Exit codes"]
    block = quickstart_block()
    assert len(block.splitlines()) <= 30
    for step in ("topics", "check", "run", "produce", "tail results", "tail dead-letters"):
        assert f"kafka-triton-worker {step}" in block
    assert '"model_name": "double"' in block


def quickstart_block() -> str:
    """The shell block between the quickstart markers."""
    section = _between("quickstart")
    found = re.fullmatch(r"```sh\n(.*?)```", section, re.S)
    assert found, "the quickstart is not one sh block"
    return found.group(1)


def test_the_two_commands_section_starts_with_make_demo_and_make_test() -> None:
    """A contributor finds `make demo` and `make test` first in "Two commands"."""
    text = README.read_text()
    section = text[text.index("## Two commands") :]
    first_block = section[section.index("```sh") : section.index("```", section.index("```sh") + 5)]
    assert "make demo" in first_block
    assert "make test" in first_block


def test_contents_links_use_githubs_anchors() -> None:
    """Backticks, colons and parentheses drop out of an anchor; spaces become hyphens."""
    assert anchor("What `make demo` shows") == "what-make-demo-shows"
    assert anchor("Kafka: TLS and SASL") == "kafka-tls-and-sasl"
    assert (
        anchor("Results (one run: `python -m devtools bench --backlog 1000000`)")
        == "results-one-run-python--m-devtools-bench---backlog-1000000"
    )
