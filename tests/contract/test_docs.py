"""The docs site: generated tables equal to the code, every page reachable, every link and
anchor resolving (on the site and on a code host), the alerts' runbook links included."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from markdown.extensions.toc import slugify

from devtools.dashboard import LAYOUT_SVG, layout_svg, panels
from devtools.docs import (
    ALERTS,
    DOCS,
    DOCS_BASE_URL,
    Part,
    alert_rules,
    anchors,
    between,
    generated_parts,
    github_anchor,
    heading_text,
    headings,
    mkdocs_anchor,
    page_of_url,
    page_url,
    pages,
)
from worker.errors import ERROR_CODES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "worker.json"


class _MkdocsLoader(yaml.SafeLoader):  # type: ignore[misc, unused-ignore]  # yaml: no stubs
    """mkdocs.yml as data: its ``!!python/name:`` tags read as plain strings."""


_MkdocsLoader.add_multi_constructor(
    "tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix
)


def mkdocs_config() -> dict[str, Any]:
    """mkdocs.yml."""
    config: dict[str, Any] = yaml.load(MKDOCS.read_text(), Loader=_MkdocsLoader)
    return config


def _nav_pages(node: Any) -> list[str]:
    """Every page the navigation names, in order."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _prose(text: str) -> str:
    """A page without its fenced code blocks and inline code, where links are not links."""
    text = re.sub(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    """The targets of a page's Markdown links and images (not those shown as code)."""
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", _prose(text))


def _documents() -> list[Path]:
    return [README, *pages()]


@pytest.mark.parametrize("part", generated_parts(), ids=lambda p: f"{p.path.name}:{p.marker}")
def test_generated_parts_equal_what_devtools_writes(part: Part) -> None:
    """Each generated table (settings, metrics, exit codes, modules, alerts, dashboard, ...)
    is what `python -m devtools schemas` writes from the code."""
    assert between(part.path.read_text(), part.marker) == part.write()


def test_the_dashboard_layout_picture_is_generated_from_the_dashboard() -> None:
    """docs/dashboard-layout.svg draws worker.json's panels at their grid places, as written."""
    assert LAYOUT_SVG.read_text() == layout_svg()
    titles = [p["title"] for p in panels()]
    assert all(f">{t}<" in LAYOUT_SVG.read_text().replace("&amp;", "&") for t in titles)


def test_every_page_is_in_the_navigation_and_every_navigation_entry_is_a_page() -> None:
    """mkdocs.yml's nav lists each page of docs/ once, and only pages that exist."""
    named = _nav_pages(mkdocs_config()["nav"])
    assert len(named) == len(set(named))
    assert sorted(named) == sorted(p.relative_to(DOCS).as_posix() for p in pages())


def test_the_build_is_strict_about_links_anchors_and_pages_left_out() -> None:
    """mkdocs.yml makes a dangling link or anchor and an omitted page a warning (so
    `--strict` fails), and draws Mermaid blocks."""
    config = mkdocs_config()
    validation = config["validation"]
    assert validation["nav"]["omitted_files"] == "warn"
    assert validation["links"]["not_found"] == "warn"
    assert validation["links"]["anchors"] == "warn"
    assert config["theme"]["name"] == "material"
    fences = next(
        ext["pymdownx.superfences"]["custom_fences"]
        for ext in config["markdown_extensions"]
        if isinstance(ext, dict) and "pymdownx.superfences" in ext
    )
    assert {"name": "mermaid", "class": "mermaid"}.items() <= fences[0].items()


@pytest.mark.parametrize("document", _documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_a_heading(document: Path) -> None:
    """Plain Markdown on a code host: each relative link names a file of the repository,
    and its #anchor a heading of that file."""
    for target in links(document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        file = (document.parent / path).resolve() if path else document
        assert file.is_file(), f"{document.name}: {target}"
        if anchor:
            assert anchor in anchors(file.read_text()), f"{document.name}: {target}"


@pytest.mark.parametrize("document", _documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_heading_has_one_anchor_on_the_site_and_on_a_code_host(document: Path) -> None:
    """Each heading's anchor is the same for Python-Markdown's toc and a code host, and
    unique on its page, so one link works in both places."""
    seen: set[str] = set()
    for _, title in headings(document.read_text()):
        anchor = mkdocs_anchor(title)
        assert anchor == slugify(heading_text(title), "-")
        assert github_anchor(title) == anchor, title
        assert anchor not in seen, f"{document.name}: two headings '{title}'"
        seen.add(anchor)


def test_every_alert_links_to_a_section_of_the_runbook() -> None:
    """Each alert's runbook_url is DOCS_BASE_URL, the runbook page's site path and one of its
    headings; no alert keeps the old README runbook annotation."""
    rules = alert_rules()
    assert len(rules) >= 10
    for rule in rules:
        annotations = rule["annotations"]
        assert "runbook" not in annotations, rule["alert"]
        url = annotations["runbook_url"]
        assert url.startswith(f"{DOCS_BASE_URL}/"), rule["alert"]
        page, anchor = page_of_url(url.removeprefix(DOCS_BASE_URL))
        assert page == DOCS / "runbook.md", rule["alert"]
        assert url == f"{DOCS_BASE_URL}/{page_url(page)}#{anchor}"
        assert anchor in anchors(page.read_text()), rule["alert"]
    assert DOCS_BASE_URL in ALERTS.read_text().split("groups:")[0]  # the comment says so


def test_site_paths_follow_mkdocs_directory_urls() -> None:
    """A page's site path is its folder and name (index pages: the folder), and back."""
    assert page_url(DOCS / "runbook.md") == "runbook/"
    assert page_url(DOCS / "index.md") == ""
    assert page_url(DOCS / "decisions" / "index.md") == "decisions/"
    assert page_of_url("decisions/#x") == (DOCS / "decisions" / "index.md", "x")
    assert mkdocs_config().get("use_directory_urls", True) is True


def _urls(node: Any) -> list[str]:
    """Every ``url`` value anywhere in a dashboard (its links and panel links)."""
    if isinstance(node, list):
        return [url for item in node for url in _urls(item)]
    if not isinstance(node, dict):
        return []
    own = [node["url"]] if isinstance(node.get("url"), str) else []
    return own + [url for value in node.values() for url in _urls(value)]


def test_the_dashboard_links_to_runbook_sections_that_exist() -> None:
    """Each link of the dashboard points into the docs site, at a heading that exists."""
    urls = _urls(json.loads(DASHBOARD.read_text()))
    assert urls
    for url in urls:
        assert url.startswith(f"{DOCS_BASE_URL}/"), url
        page, anchor = page_of_url(url.removeprefix(DOCS_BASE_URL))
        assert page.is_file(), url
        assert not anchor or anchor in anchors(page.read_text()), url


def test_the_runbook_names_only_panels_the_dashboard_has() -> None:
    """Every panel the runbook quotes ("Paused partitions", ...) is a panel of worker.json."""
    titles = {p["title"] for p in panels()}
    quoted = set(re.findall(r'"([A-Z][^"\n]*)"', _prose((DOCS / "runbook.md").read_text())))
    assert quoted
    assert quoted - titles == set()


def test_the_dead_letter_codes_table_lists_every_code_in_order() -> None:
    """The wire contract's table of dead-letter codes is the worker's codes, in their order."""
    text = (DOCS / "wire-contract.md").read_text()
    section = text[text.index("## Dead-letter codes") :]
    listed = re.findall(r"^\| `([A-Z_]+)` \|", section, re.M)
    assert listed == list(ERROR_CODES)


def test_the_runbook_says_what_to_do_for_every_dead_letter_code() -> None:
    """ "Dead letters rising" has a row for each dead-letter code."""
    text = (DOCS / "runbook.md").read_text()
    section = text[text.index("## Dead letters rising") : text.index("### Replaying")]
    rows = re.findall(r"^\| (`[A-Z_]+`(?:, `[A-Z_]+`)*) \|", section, re.M)
    codes = [code for row in rows for code in re.findall(r"`([A-Z_]+)`", row)]
    assert sorted(codes) == sorted(ERROR_CODES)


def test_decision_records_are_numbered_and_say_context_decision_consequences() -> None:
    """docs/decisions/NNNN-title.md: numbered 1, 2, 3 ... with the three sections."""
    records = sorted((DOCS / "decisions").glob("[0-9]*.md"))
    assert [int(p.name[:4]) for p in records] == list(range(1, len(records) + 1))
    for record in records:
        level_two = [t for level, t in headings(record.read_text()) if level == 2]
        assert level_two == ["Context", "Decision", "Consequences"], record.name
        assert headings(record.read_text())[0][1].startswith(f"{int(record.name[:4]):04d}. ")


def test_benchmark_runs_are_dated_pages() -> None:
    """docs/benchmarks/YYYY-MM-DD-title.md, each titled with its date."""
    runs = [p for p in (DOCS / "benchmarks").glob("*.md") if p.name != "index.md"]
    assert runs
    for run in runs:
        date = re.match(r"(\d{4}-\d{2}-\d{2})-[a-z0-9-]+\.md$", run.name)
        assert date, run.name
        assert headings(run.read_text())[0][1].startswith(date.group(1))


def test_make_docs_builds_the_site_and_the_lint_step_builds_it_strictly() -> None:
    """`make docs` builds into site/ (git-ignored); `make test`'s lint step runs
    `mkdocs build --strict`; the docs extra and its pins install it."""
    makefile = (ROOT / "Makefile").read_text()
    lint = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert lint and "-m mkdocs build --strict" in lint.group(1)
    docs = re.search(r"^docs:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert docs and "-m mkdocs build --strict" in docs.group(1)
    assert "site/" in (ROOT / ".gitignore").read_text().split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = {re.split(r"[<>=\[]", r)[0] for r in project["optional-dependencies"]["docs"]}
    assert extra == {"mkdocs", "mkdocs-material"}
    pins = (ROOT / "constraints.txt").read_text().split()
    assert any(p.startswith("mkdocs==") for p in pins)
    assert any(p.startswith("mkdocs-material==") for p in pins)
    assert ".[test,bench,docs]" in makefile
