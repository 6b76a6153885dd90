"""The Grafana dashboard as documentation: its layout as a picture, its panels with their queries.

Both are read off ``deploy/grafana/dashboards/worker.json``; ``python -m devtools schemas``
writes them into ``docs/dashboard.md`` and ``docs/dashboard-layout.svg``, and contract
tests keep the committed files equal to what this module writes.
"""

from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = PROJECT_ROOT / "deploy" / "grafana" / "dashboards" / "worker.json"
LAYOUT_SVG = PROJECT_ROOT / "docs" / "dashboard-layout.svg"

#: Pixels of one grid column and of one grid row unit (Grafana: 24 columns, rows of 30 px).
_COLUMN = 40
_ROW = 18
_FONT = "font-family:sans-serif;font-size:12px"
_MONO = "font-family:monospace;font-size:10px;fill:#3d71d9"
#: Pixels of one character at that size: a metric name longer than its box is cut.
_MONO_WIDTH = 6


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, rows included, top to bottom and left to right."""
    doc = json.loads(DASHBOARD.read_text())
    found: list[dict[str, Any]] = doc["panels"]
    return sorted(found, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def metric_names(panel: dict[str, Any]) -> list[str]:
    """The metrics a panel queries, in order of first mention (histogram suffixes kept)."""
    text = " ".join(target["expr"] for target in panel.get("targets", []))
    return list(dict.fromkeys(re.findall(r"\b(?:worker|nv)_[a-z0-9_]+|\bup\b", text)))


def panels_markdown() -> str:
    """Each row as a heading, each panel under it: its kind, place, meaning and queries."""
    out: list[str] = []
    for panel in panels():
        grid = panel["gridPos"]
        if panel["type"] == "row":
            out.append(f"### {panel['title']}\n")
            continue
        out.append(f"#### {panel['title']}\n")
        place = f"{grid['w']} wide, {grid['h']} high, at column {grid['x']}, row {grid['y']}"
        out.append(f"{panel['type']}, {place}. {panel.get('description', '')}".strip() + "\n")
        for target in panel.get("targets", []):
            legend = target.get("legendFormat")
            comment = f"# legend: {legend}\n" if legend else ""
            out.append(f"```promql\n{comment}{target['expr']}\n```\n")
    return "\n".join(out)


def layout_svg() -> str:
    """The panels as boxes at their places on the grid, each with its title."""
    items = panels()
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in items) * _ROW
    width = 24 * _COLUMN
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f'<rect width="{width}" height="{height}" fill="#f4f5f5"/>',
    ]
    for panel in items:
        grid = panel["gridPos"]
        x, y = grid["x"] * _COLUMN, grid["y"] * _ROW
        w, h = grid["w"] * _COLUMN, grid["h"] * _ROW
        title = escape(panel["title"])
        if panel["type"] == "row":
            out.append(
                f'<text x="{x + 4}" y="{y + _ROW - 6}" style="{_FONT};font-weight:bold">'
                f"{title}</text>"
            )
            continue
        out.append(
            f'<rect x="{x + 2}" y="{y + 2}" width="{w - 4}" height="{h - 4}" rx="3" '
            'fill="#ffffff" stroke="#8e8e8e"/>'
        )
        out.append(f'<text x="{x + 8}" y="{y + 18}" style="{_FONT}">{title}</text>')
        out.append(
            f'<text x="{x + 8}" y="{y + 34}" style="{_FONT};fill:#6e6e6e">'
            f"{escape(panel['type'])}</text>"
        )
        fits = (w - 16) // _MONO_WIDTH
        for line, name in enumerate(metric_names(panel)):
            shown = name if len(name) <= fits else name[: fits - 1] + "…"
            out.append(
                f'<text x="{x + 8}" y="{y + 50 + 13 * line}" style="{_MONO}">{escape(shown)}</text>'
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"
