"""The README's contents and exit-code table, generated from the README and from ``ExitCode``.

``python -m devtools schemas`` writes them between their markers; contract tests keep
the README equal to what this module generates, so neither drifts from what it lists.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from pathlib import Path

from worker.errors import ExitCode

PROJECT_ROOT = Path(__file__).resolve().parents[1]
README = PROJECT_ROOT / "README.md"
ERRORS = PROJECT_ROOT / "worker" / "errors.py"


def headings(text: str) -> list[tuple[int, str]]:
    """The README's ``##`` and ``###`` headings (level, title), outside code blocks."""
    found: list[tuple[int, str]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#{2,3}) (.+)$", line)):
            found.append((len(match[1]), match[2].strip()))
    return found


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(
        char
        for char in title.lower()
        if char in " -_" or unicodedata.category(char)[0] in ("L", "M", "N")
    )
    return kept.replace(" ", "-")


def contents_markdown(text: str) -> str:
    """One line per ``##`` section, its ``###`` subsections after it, each a link."""
    lines: list[str] = []
    seen: dict[str, int] = {}

    def link(title: str) -> str:
        slug = anchor(title)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        label = title.replace("`", "")
        return f"[{label}](#{slug}{f'-{count}' if count else ''})"

    for level, title in headings(text):
        if title == "Contents":
            seen[anchor(title)] = 1
            continue
        if level == 2:
            lines.append(f"- {link(title)}")
        elif lines:
            separator = ": " if lines[-1].count("](") == 1 else " · "
            lines[-1] += separator + link(title)
    return "\n".join(lines) + "\n"


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
    """The README's table of exit codes."""
    out = ["| code | name | meaning |", "| --- | --- | --- |"]
    for code, name, meaning in exit_codes():
        out.append(f"| {code} | `{name}` | {meaning.replace('``', '`')} |")
    return "\n".join(out) + "\n"
