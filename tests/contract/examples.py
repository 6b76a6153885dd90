"""The examples of the docs pages and the README: their shell blocks and their JSON blocks.

Shell blocks (```sh) are split into commands the way a shell would read them: comments
dropped, continued lines joined, here-documents set apart, ``&&``, ``;``, ``|`` and ``&``
ending a command. JSON blocks (```json) are requests, results or audit records; a
request and the result shown after it share an ``id``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.docs import DOCS, README, pages

_BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_OPERATORS = {"&&", "||", ";", "|", "&"}


def documents() -> list[Path]:
    """The README and every page of docs/."""
    return [README, *pages()]


def name(path: Path) -> str:
    """A document's name as the tests show it."""
    return "README.md" if path == README else path.relative_to(DOCS).as_posix()


def blocks(language: str) -> list[tuple[Path, str]]:
    """Every fenced block of ``language`` in the README and the pages, with its document."""
    return [
        (path, match.group(2))
        for path in documents()
        for match in _BLOCK.finditer(path.read_text())
        if match.group(1) == language
    ]


@dataclass
class Script:
    """One shell block, read: its commands (argv lists) and its here-documents' bodies."""

    commands: list[list[str]] = field(default_factory=list)
    heredocs: list[str] = field(default_factory=list)


def read_script(block: str) -> Script:
    """A shell block as a shell would split it (no expansion: ``$!`` stays as written)."""
    script = Script()
    lines = block.replace("\\\n", " ").splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            end = lines.index(heredoc.group(1), index)
            script.heredocs.append("\n".join(lines[index:end]))
            index = end + 1
            line = line[: heredoc.start()]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in _OPERATORS:
                script.commands.append(current)
                current = []
            else:
                current.append(token)
        script.commands.append(current)
    script.commands = [_without_redirections(c) for c in script.commands if c]
    return script


def _without_redirections(argv: list[str]) -> list[str]:
    """``cmd 2> log`` -> ``cmd``: a redirection, its descriptor and its target are no arguments."""
    kept: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token in (">", ">>", "<"):
            next(tokens, None)
            if kept and kept[-1].isdigit():
                kept.pop()
        else:
            kept.append(token)
    return kept


def json_examples() -> list[tuple[Path, dict[str, Any]]]:
    """Every JSON block, parsed."""
    return [(path, json.loads(block)) for path, block in blocks("json")]


def is_request(example: dict[str, Any]) -> bool:
    """A JSON inference request: it has inputs."""
    return "inputs" in example


def is_result(example: dict[str, Any]) -> bool:
    """A JSON inference result: it has outputs."""
    return "outputs" in example


def documented_result(path: Path, request_id: str) -> dict[str, Any] | None:
    """The result a page shows for the request of this id, if it shows one."""
    return next(
        (ex for p, ex in json_examples() if p == path and is_result(ex) and ex["id"] == request_id),
        None,
    )
