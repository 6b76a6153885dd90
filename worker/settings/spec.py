"""One setting as the environment, the flags and the docs see it, read off its declaration."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from worker.settings.fields import Doc
from worker.settings.parsers import MIB, ValueKind, kind_of

__all__ = ["ENV_PREFIX", "SettingSpec", "specs_of"]

ENV_PREFIX = "WORKER_"


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """One setting as read from the environment and flags, and as documented."""

    section: str
    field: str
    env: str
    flag: str
    kind: ValueKind
    doc: Doc
    required: bool
    default: object  # None when required or computed by a factory

    @property
    def help(self) -> str:
        return self.doc.help

    @property
    def secret(self) -> bool:
        return self.doc.secret

    def get(self, settings: Any) -> Any:
        return getattr(getattr(settings, self.section), self.field)

    def default_doc(self) -> str:
        """How the default reads in the settings reference and ``--help``."""
        if self.doc.default_doc is not None:
            return self.doc.default_doc
        if self.required:
            return "required"
        value = self.default
        if value is None:
            return "(none)"
        if isinstance(value, int) and not isinstance(value, bool):
            if value >= MIB and value % MIB == 0:
                return f"{value // MIB}MiB"
        return str(value)

    def default_is_value(self) -> bool:
        """True when ``default_doc`` is the literal default rather than prose."""
        return self.doc.default_doc is None and not self.required and self.default is not None


def specs_of(section: str, cls: type[msgspec.Struct]) -> Iterator[SettingSpec]:
    hints = typing.get_type_hints(cls, include_extras=True)
    for info in msgspec.structs.fields(cls):
        annotation = hints[info.name]
        doc = next(e for e in typing.get_args(annotation) if isinstance(e, Doc))
        required = info.required
        default = None if required or info.default is msgspec.NODEFAULT else info.default
        yield SettingSpec(
            section=section,
            field=info.name,
            env=ENV_PREFIX + info.name.upper(),
            flag="--" + info.name.replace("_", "-"),
            kind=kind_of(annotation, info.name),
            doc=doc,
            required=required,
            default=default,
        )
