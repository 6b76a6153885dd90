"""The README's reference tables are the ones the code generates."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_readme_starts_with_the_two_commands() -> None:
    """A newcomer finds `make demo` and `make test` before anything else."""
    text = README.read_text()
    first_block = text[text.index("```sh") : text.index("```", text.index("```sh") + 5)]
    assert "make demo" in first_block
    assert "make test" in first_block
