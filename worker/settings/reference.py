"""The settings as the reference table of docs/configuration.md (a contract test keeps it equal)."""

from __future__ import annotations

from worker.settings.schema import SETTINGS_SPEC

__all__ = ["reference_table_markdown"]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def reference_table_markdown() -> str:
    """The settings as a Markdown table (env var | flag | type | default | meaning)."""
    lines = ["| env var | flag | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for spec in SETTINGS_SPEC:
        default = spec.default_doc()
        cells = [
            f"`{spec.env}`",
            f"`{spec.flag}`",
            spec.kind.type_doc(),
            f"`{default}`" if spec.default_is_value() else _md(default),
            _md(spec.help),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
