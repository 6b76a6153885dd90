"""``schemas``: write ``schemas/`` and the README's generated tables from the code.

The schemas come from the wire types (``worker.wire.messages.generate_schemas``), the
tables from the settings, metrics and exit-code declarations, the contents from the
README's own headings; contract tests keep the committed files equal to what this writes.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from worker.observability import metrics_reference_markdown
from worker.settings import reference_table_markdown
from worker.wire.messages import generate_schemas

PROJECT_ROOT = Path(__file__).resolve().parents[1]
README = PROJECT_ROOT / "README.md"


def render_schema(schema: dict[str, Any]) -> str:
    """Canonical text of a schema file: indent 2, sorted keys, trailing newline."""
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def default_schema_dir() -> Path:
    """The repository's `schemas/` directory."""
    return PROJECT_ROOT / "schemas"


def write_schemas(directory: Path | None = None) -> list[Path]:
    """Write every generated schema to `directory` (default `schemas/`)."""
    target = directory or default_schema_dir()
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in generate_schemas().items():
        path = target / name
        path.write_text(render_schema(schema), encoding="utf-8")
        written.append(path)
    return written


def readme_sections(text: str | None = None) -> dict[str, str]:
    """Each generated README section, by its marker name (``text``: the README's)."""
    from devtools.layout import module_table_markdown
    from devtools.readme import contents_markdown, exit_codes_markdown

    return {
        "contents": contents_markdown(README.read_text() if text is None else text),
        "exit-codes-table": exit_codes_markdown(),
        "settings-table": reference_table_markdown(),
        "metrics-table": metrics_reference_markdown(),
        "module-table": module_table_markdown(),
    }


def write_readme(path: Path = README) -> None:
    """Replace every generated section of the README (between its markers)."""
    text = path.read_text()
    for marker, body in readme_sections(text).items():
        pattern = re.compile(rf"(<!-- {marker}:start[^>]*-->\n)(.*?)(<!-- {marker}:end -->)", re.S)

        def replace(match: re.Match[str], body: str = body) -> str:
            return match.group(1) + body + match.group(3)

        text = pattern.sub(replace, text)
    path.write_text(text)


def add_schemas_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    schemas = commands.add_parser(
        "schemas", help="write schemas/ and the README's generated tables from the code"
    )
    schemas.add_argument("--out", type=Path, default=None, help="schema folder (default schemas/)")
    schemas.set_defaults(handler=run_schemas)


def run_schemas(args: argparse.Namespace) -> int:
    for path in write_schemas(args.out):
        print(path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path)
    write_readme()
    print("README.md (generated tables)")
    return 0
