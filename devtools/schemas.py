"""``schemas``: write ``schemas/`` and the documentation's generated parts from the code.

The schemas come from the wire types (``worker.wire.messages.generate_schemas``); the
tables of the docs pages and the README from the settings, metrics, exit-code, module,
alert and dashboard declarations (``devtools.docs``, ``devtools.dashboard``); contract
tests keep the committed files equal to what this writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from devtools.dashboard import LAYOUT_SVG, layout_svg
from devtools.docs import write_generated
from worker.wire.messages import generate_schemas

PROJECT_ROOT = Path(__file__).resolve().parents[1]


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


def add_schemas_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    schemas = commands.add_parser(
        "schemas", help="write schemas/ and the docs' generated tables from the code"
    )
    schemas.add_argument("--out", type=Path, default=None, help="schema folder (default schemas/)")
    schemas.set_defaults(handler=run_schemas)


def run_schemas(args: argparse.Namespace) -> int:
    for path in write_schemas(args.out):
        print(path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path)
    for path in write_generated():
        print(path.relative_to(PROJECT_ROOT))
    LAYOUT_SVG.write_text(layout_svg())
    print(LAYOUT_SVG.relative_to(PROJECT_ROOT))
    return 0
