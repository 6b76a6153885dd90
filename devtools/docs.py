"""The documentation's generated parts, and how its pages, headings and links are read.

A generated part sits between ``<!-- name:start ... -->`` and ``<!-- name:end -->`` in a
page of ``docs/`` or in the README; :func:`generated_parts` says which file holds each
and which function writes it. ``python -m devtools schemas`` writes them all, and
contract tests keep every committed part equal to what is written here, so no table
drifts from what it lists.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.errors import ExitCode

PROJECT_ROOT = Path(__file__).resolve().parents[1]
README = PROJECT_ROOT / "README.md"
DOCS = PROJECT_ROOT / "docs"
ERRORS = PROJECT_ROOT / "worker" / "errors.py"
ALERTS = PROJECT_ROOT / "deploy" / "prometheus" / "alerts.yml"
#: Where the alerts' ``runbook_url``s start: replaced by the address the docs are served at.
DOCS_BASE_URL = "DOCS_BASE_URL"

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6}) (.+?)\s*#*\s*$")


def headings(text: str) -> list[tuple[int, str]]:
    """Every Markdown heading of ``text`` (level, title), outside fenced code blocks."""
    found: list[tuple[int, str]] = []
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := _HEADING.match(line)):
            found.append((len(match[1]), match[2].strip()))
    return found


def heading_text(title: str) -> str:
    """A heading as it reads: code marks, emphasis and link targets dropped."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    return title.replace("`", "").replace("**", "").replace("*", "")


def github_anchor(title: str) -> str:
    """A code host's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(
        char
        for char in heading_text(title).lower()
        if char in " -_" or unicodedata.category(char)[0] in ("L", "M", "N")
    )
    return kept.replace(" ", "-")


def mkdocs_anchor(title: str) -> str:
    """The site's anchor of a heading, as Python-Markdown's ``toc`` extension makes it."""
    value = unicodedata.normalize("NFKD", heading_text(title))
    value = value.encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(text: str) -> set[str]:
    """The anchors a page's headings get on the site (and, checked, on a code host)."""
    return {mkdocs_anchor(title) for _, title in headings(text)}


def pages() -> list[Path]:
    """Every Markdown page of ``docs/``."""
    return sorted(DOCS.rglob("*.md"))


def page_url(page: Path) -> str:
    """The site path of a page (directory URLs): ``docs/runbook.md`` -> ``runbook/``."""
    relative = page.relative_to(DOCS).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "index" else relative.parts
    return "".join(f"{part}/" for part in parts)


def page_of_url(url: str) -> tuple[Path, str]:
    """The page and anchor a site URL (``runbook/#lag-rising``, base removed) points at."""
    path, _, anchor = url.partition("#")
    path = path.strip("/")
    page = DOCS / path / "index.md" if (DOCS / path / "index.md").exists() else DOCS / f"{path}.md"
    return page, anchor


def exit_codes() -> list[tuple[int, str, str]]:
    """(code, name, meaning) of every ``ExitCode``, the meaning read off its ``#:`` comment."""
    source = ERRORS.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    enum = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ExitCode")
    rows = []
    for node in enum.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        comment: list[str] = []
        index = node.lineno - 2
        while index >= 0 and lines[index].strip().startswith("#:"):
            comment.insert(0, lines[index].strip()[2:].strip())
            index -= 1
        if not comment:
            raise ValueError(f"ExitCode.{name} has no #: comment to document it")
        rows.append((int(ExitCode[name]), name, " ".join(comment)))
    if {name for _, name, _ in rows} != set(ExitCode.__members__):
        raise ValueError("ExitCode has members this reader does not see")
    return rows


def exit_codes_markdown() -> str:
    """The table of exit codes."""
    out = ["| code | name | meaning |", "| --- | --- | --- |"]
    for code, name, meaning in exit_codes():
        out.append(f"| {code} | `{name}` | {meaning.replace('``', '`')} |")
    return "\n".join(out) + "\n"


def _title(page: Path) -> str:
    """A page's title: its first ``#`` heading."""
    return next(title for level, title in headings(page.read_text()) if level == 1)


def _records(folder: str) -> list[Path]:
    return sorted(p for p in (DOCS / folder).glob("*.md") if p.name != "index.md")


def decisions_index_markdown() -> str:
    """The list of decision records, in their order."""
    return "".join(f"- [{_title(p)}]({p.name})\n" for p in _records("decisions"))


def benchmarks_index_markdown() -> str:
    """The list of benchmark runs, newest first."""
    return "".join(f"- [{_title(p)}]({p.name})\n" for p in reversed(_records("benchmarks")))


def readme_records_markdown() -> str:
    """The README's links to every benchmark run and decision record."""

    def link(page: Path) -> str:
        return f"[{_title(page)}]({page.relative_to(PROJECT_ROOT).as_posix()})"

    runs = " · ".join(link(p) for p in reversed(_records("benchmarks")))
    decisions = " · ".join(link(p) for p in _records("decisions"))
    return f"Benchmark runs: {runs}.\n\nDecisions: {decisions}.\n"


def alert_rules() -> list[dict[str, Any]]:
    """The alerting rules of ``deploy/prometheus/alerts.yml``, in file order."""
    import yaml

    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


def runbook_link(url: str) -> str:
    """A ``runbook_url`` as a relative link: ``DOCS_BASE_URL/runbook/#x`` -> ``runbook.md#x``."""
    page, anchor = page_of_url(url.removeprefix(DOCS_BASE_URL))
    return f"{page.relative_to(DOCS).as_posix()}#{anchor}"


def alerts_table_markdown() -> str:
    """The table of alerts: severity, wait, what it says, and the runbook section to read."""
    out = ["| alert | severity | for | summary | runbook |", "| --- | --- | --- | --- | --- |"]
    for rule in alert_rules():
        annotations = rule["annotations"]
        target = runbook_link(annotations["runbook_url"])
        section = _heading_of(target)
        summary = annotations["summary"].replace("{{", "`{{").replace("}}", "}}`")
        out.append(
            f"| `{rule['alert']}` | {rule['labels']['severity']} | {rule.get('for', '-')} "
            f"| {summary} | [{section}]({target}) |"
        )
    return "\n".join(out) + "\n"


def _heading_of(target: str) -> str:
    """The title of the heading ``page.md#anchor`` points at."""
    page, _, anchor = target.partition("#")
    titles = headings((DOCS / page).read_text())
    return next(title for _, title in titles if mkdocs_anchor(title) == anchor)


def schemas_table_markdown() -> str:
    """The table of the committed JSON Schemas: file, title, what it describes."""
    from worker.wire.messages import generate_schemas

    out = ["| file | title | describes |", "| --- | --- | --- |"]
    for name, schema in sorted(generate_schemas().items()):
        out.append(f"| `schemas/{name}` | {schema['title']} | {schema['description']} |")
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Part:
    """One generated part: the file that holds it, its marker, the function writing it."""

    path: Path
    marker: str
    write: Callable[[], str]


def generated_parts() -> list[Part]:
    """Every generated part of the README and of ``docs/``."""
    from devtools.dashboard import panels_markdown
    from devtools.layout import module_table_markdown
    from worker.observability import metrics_reference_markdown
    from worker.settings import reference_table_markdown

    return [
        Part(README, "records", readme_records_markdown),
        Part(DOCS / "running.md", "exit-codes-table", exit_codes_markdown),
        Part(DOCS / "configuration.md", "settings-table", reference_table_markdown),
        Part(DOCS / "observability.md", "metrics-table", metrics_reference_markdown),
        Part(DOCS / "observability.md", "alerts-table", alerts_table_markdown),
        Part(DOCS / "how-it-works.md", "module-table", module_table_markdown),
        Part(DOCS / "wire-contract.md", "schemas-table", schemas_table_markdown),
        Part(DOCS / "dashboard.md", "dashboard-panels", panels_markdown),
        Part(DOCS / "decisions" / "index.md", "decisions-index", decisions_index_markdown),
        Part(DOCS / "benchmarks" / "index.md", "benchmarks-index", benchmarks_index_markdown),
    ]


def _marked(marker: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {marker}:start[^>]*-->\n)(.*?)(<!-- {marker}:end -->)", re.S)


def between(text: str, marker: str) -> str | None:
    """What a page holds between a marker's start and end, or None without the markers."""
    found = _marked(marker).search(text)
    return found.group(2) if found else None


def write_generated() -> Iterator[Path]:
    """Write every generated part between its markers; yield each file written."""
    by_path: dict[Path, list[Part]] = {}
    for part in generated_parts():
        by_path.setdefault(part.path, []).append(part)
    for path, parts in by_path.items():
        text = path.read_text()
        for part in parts:
            if between(text, part.marker) is None:
                raise ValueError(f"{path.name} lacks the {part.marker} markers")
            body = part.write()

            def replace(match: re.Match[str], body: str = body) -> str:
                return match.group(1) + body + match.group(3)

            text = _marked(part.marker).sub(replace, text)
        path.write_text(text)
        yield path
