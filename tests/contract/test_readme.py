"""The README is short: what the worker is, the quickstart, installing, a map of the docs."""

from __future__ import annotations

import re
from pathlib import Path

from devtools.docs import DOCS, between, github_anchor, headings, mkdocs_anchor, pages

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The issue's bound: a README a newcomer reads through.
MAX_WORDS = 1500


def _between(path: Path, marker: str) -> str:
    found = between(path.read_text(), marker)
    assert found is not None, f"{path.name} lacks the {marker} markers"
    return found


def quickstart_block(path: Path = README) -> str:
    """The shell block between the quickstart markers."""
    found = re.fullmatch(r"```sh\n(.*?)```\n", _between(path, "quickstart"), re.S)
    assert found, "the quickstart is not one sh block"
    return found.group(1)


def test_readme_is_at_most_1500_words() -> None:
    """The README stays a page: at most 1,500 words, everything else on the docs pages."""
    assert len(README.read_text().split()) <= MAX_WORDS


def test_readme_links_every_page_of_the_docs() -> None:
    """Each page of docs/ (decisions and benchmark runs included) is linked from the README."""
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text()))
    assert {p.relative_to(ROOT).as_posix() for p in pages()} - linked == set()


def test_readme_opens_with_a_diagram_then_the_quickstart() -> None:
    """What it is, one diagram, then the quickstart: topics, check, run, a request, tail."""
    text = README.read_text()
    sections = [title for level, title in headings(text) if level == 2]
    assert sections == [
        "Quickstart: your Kafka, your Triton",
        "Install",
        "Two commands",
        "Documentation",
        "Licence",
    ]
    assert text.index("```mermaid") < text.index("## Quickstart")
    block = quickstart_block()
    assert len(block.splitlines()) <= 30
    for step in ("topics", "check", "run", "produce", "tail results", "tail dead-letters"):
        assert f"kafka-triton-worker {step}" in block
    assert '"model_name": "double"' in block


def test_the_getting_started_page_shows_the_same_quickstart() -> None:
    """The quickstart the test runs is the one on the Getting started page too."""
    assert quickstart_block(DOCS / "getting-started.md") == quickstart_block()


def test_the_architecture_diagram_is_the_same_in_the_readme_and_on_the_home_page() -> None:
    """One architecture diagram: the README's and docs/index.md's are equal."""
    assert _between(README, "architecture") == _between(DOCS / "index.md", "architecture")
    diagram = _between(README, "architecture")
    for stage in ("intake", "window", "wire", "triton", "publisher", "delivery"):
        assert f"{stage}[" in diagram or f"{stage} -->" in diagram, stage


def test_the_two_commands_section_starts_with_make_demo_and_make_test() -> None:
    """A contributor finds `make demo` and `make test` first in "Two commands"."""
    text = README.read_text()
    section = text[text.index("## Two commands") :]
    first_block = section[section.index("```sh") : section.index("```", section.index("```sh") + 5)]
    assert "make demo" in first_block
    assert "make test" in first_block


def test_anchors_drop_punctuation_the_same_way_on_a_code_host_and_on_the_site() -> None:
    """Backticks, colons and parentheses drop out of an anchor; spaces become hyphens."""
    for title, anchor in {
        "What `make demo` shows": "what-make-demo-shows",
        "Kafka: TLS and SASL": "kafka-tls-and-sasl",
        "Models failing (failure-rate breaker)": "models-failing-failure-rate-breaker",
    }.items():
        assert github_anchor(title) == mkdocs_anchor(title) == anchor
    # Where they part: a code host keeps each hyphen, the site folds a run into one.
    assert github_anchor("a / b") == "a--b" != mkdocs_anchor("a / b")
