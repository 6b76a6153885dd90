"""What a setting's text may be: typed by msgspec ``Annotated`` constraints, plus a few hooks.

A setting's type is an ordinary annotation (``int``, ``float``, ``bool``, ``str``, a
``Literal`` of choices, optionally ``| None``) with msgspec ``Meta`` constraints;
msgspec checks the typed value. Text forms msgspec does not know (sizes such as
``8MiB``, comma-separated lists, ``host:port``, the allowlist rules) have a small
``Hook`` in the annotation that turns the text into the typed value first. From the
same annotation come the type column of the settings reference (docs/configuration.md), the
``--help`` placeholder and the "must be ..." of an error.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "MIB",
    "Hook",
    "ValueKind",
    "allowlist",
    "host_port",
    "host_ports",
    "kind_of",
    "seconds",
    "size",
    "topic",
    "topics",
]

MIB = 1024 * 1024

_TOPIC_RE = r"^[A-Za-z0-9._-]{1,249}$"
_HOST_PORT_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")
_SIZE_RE = re.compile(r"([0-9]+)\s*(B|KiB|MiB|GiB)?")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}
_TRUTH = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True, slots=True)
class Hook:
    """Text to typed value for a form msgspec does not read, and how the form is described."""

    convert: Callable[[str], object]
    type_doc: str  # the settings reference's type column
    metavar: str  # the --help placeholder
    expected: str  # completes "must be ..."
    check: Callable[[object], bool] = lambda _: True  # beyond the msgspec constraints


# -- the hooks --------------------------------------------------------------------------


def _size(raw: str) -> int:
    match = _SIZE_RE.fullmatch(raw)
    if match is None:
        raise ValueError(raw)
    return int(match[1]) * _SIZE_UNITS[match[2]]


def size(low: int) -> Hook:
    """A byte count: ``1048576`` or ``1MiB`` (B, KiB, MiB, GiB)."""
    return Hook(
        _size,
        "bytes (suffix KiB, MiB, GiB allowed)",
        "SIZE",
        f"a size in bytes >= {low}, such as 1048576 or 1MiB",
    )


def _is_topic(name: object) -> bool:
    return (
        isinstance(name, str)
        and re.fullmatch(_TOPIC_RE, name) is not None
        and name not in {".", ".."}
    )


TOPIC_META = msgspec.Meta(pattern=_TOPIC_RE)


def topic() -> Hook:
    """One Kafka topic name."""
    return Hook(str, "topic name", "TOPIC", "a Kafka topic name ([A-Za-z0-9._-])", _is_topic)


def topics() -> Hook:
    """Distinct topic names separated by commas."""

    def check(value: object) -> bool:
        return (
            isinstance(value, tuple)
            and 0 < len(value) == len(set(value))
            and all(_is_topic(name) for name in value)
        )

    return Hook(
        lambda raw: tuple(part.strip() for part in raw.split(",")),
        "comma-separated topic names",
        "TOPIC[,TOPIC...]",
        "one or more distinct Kafka topic names, comma-separated",
        check,
    )


def _is_host_port(text: str) -> bool:
    match = _HOST_PORT_RE.fullmatch(text)
    return match is not None and 1 <= int(match[2]) <= 65535


def host_port() -> Hook:
    """``host:port``, no scheme."""
    return Hook(
        str,
        "host:port",
        "HOST:PORT",
        "host:port (no scheme, port 1-65535)",
        lambda v: isinstance(v, str) and _is_host_port(v),
    )


def host_ports() -> Hook:
    """``host:port`` pairs separated by commas."""
    return Hook(
        lambda raw: ",".join(part.strip() for part in raw.split(",")),
        "comma-separated host:port",
        "HOST:PORT[,...]",
        "host:port pairs separated by commas (no scheme, port 1-65535)",
        lambda v: isinstance(v, str) and all(_is_host_port(p) for p in v.split(",")),
    )


def _rules(raw: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    rules = []
    for part in filter(None, (p.strip() for p in raw.split(";"))):
        name, sep, models = part.partition("=")
        if not sep:
            raise ValueError(part)
        rules.append((name.strip(), tuple(m.strip() for m in models.split("|") if m.strip())))
    return tuple(rules)


def allowlist() -> Hook:
    """``topic=model|model;topic2=*``: which models each input topic may ask for."""

    def check(value: object) -> bool:
        return isinstance(value, tuple) and all(
            _is_topic(name) and len(models) > 0 for name, models in value
        )

    return Hook(
        _rules,
        "topic=model\\|model;...",
        "RULES",
        "rules like 'requests=double|mlp;other=*' (topic=models separated by |)",
        check,
    )


#: Seconds: finite and > 0 (NaN and infinity would make every deadline nonsense).
seconds = msgspec.Meta(gt=0, lt=1e12)


# -- reading an annotation ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ValueKind:
    """How one setting's text is read, checked and described."""

    annotation: Any  # the full annotation, for msgspec
    base: Any  # the type without None and Annotated
    optional: bool
    hook: Hook | None
    meta: msgspec.Meta | None
    unit_seconds: bool  # a float named *_s

    @property
    def choices(self) -> tuple[str, ...]:
        return typing.get_args(self.base) if typing.get_origin(self.base) is Literal else ()

    def type_doc(self) -> str:
        """The settings reference's type column."""
        if self.hook is not None:
            return self.hook.type_doc
        if self.choices:
            return " \\| ".join(self.choices)
        if self.base is bool:
            return "true \\| false"
        if self.base is int:
            low, high = self._bounds()
            return f"integer {low}..{high}" if high is not None else f"integer >= {low}"
        if self.base is float:
            return "seconds > 0" if self.unit_seconds else "number >= 0"
        return "string"

    def metavar(self) -> str:
        if self.hook is not None:
            return self.hook.metavar
        if self.choices:
            return "{" + ",".join(self.choices) + "}"
        if self.base is bool:
            return "{true,false}"
        if self.base is float and self.unit_seconds:
            return "SECONDS"
        return "N" if self.base in (int, float) else "TEXT"

    def expected(self) -> str:
        """Completes "must be ..."."""
        if self.hook is not None:
            return self.hook.expected
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.base is bool:
            return "true or false"
        if self.base is int:
            low, high = self._bounds()
            if high is not None:
                return f"an integer from {low} to {high}"
            return f"an integer >= {low}"
        if self.base is float:
            return "a number of seconds > 0" if self.unit_seconds else "a number >= 0"
        return "a non-empty string"

    def _bounds(self) -> tuple[int, int | None]:
        meta = self.meta
        low = meta.ge if meta is not None and meta.ge is not None else 0
        high = meta.le if meta is not None else None
        return int(low), None if high is None else int(high)

    def parse(self, raw: str) -> object:
        """Text (stripped) to the typed, checked value; ValueError("must be ...") if wrong."""
        raw = raw.strip()
        if self.optional and not raw:
            return None
        try:
            value = self._convert(raw)
        except ValueError:
            raise ValueError(f"must be {self.expected()}") from None
        self.check(value)
        return value

    def _convert(self, raw: str) -> object:
        if self.hook is not None:
            return self.hook.convert(raw)
        if self.choices:
            # Case-insensitive, but the value is always the canonical spelling.
            return next((c for c in self.choices if c.lower() == raw.lower()), raw)
        if self.base is bool:
            if raw.lower() not in _TRUTH:
                raise ValueError(raw)
            return _TRUTH[raw.lower()]
        if self.base is int:
            return int(raw)
        if self.base is float:
            return float(raw)
        return raw

    def check(self, value: object) -> None:
        """Check a typed value against the annotation; ValueError("must be ...") if wrong."""
        if value is None and self.optional:
            return
        if isinstance(value, bool) and self.base in (int, float):
            raise ValueError(f"must be {self.expected()}")
        try:
            msgspec.convert(value, self.annotation, strict=self.base is not float)
        except msgspec.ValidationError:
            raise ValueError(f"must be {self.expected()}") from None
        if self.hook is not None and not self.hook.check(value):
            raise ValueError(f"must be {self.expected()}")
        if self.base is str and not (isinstance(value, str) and value.strip()):
            raise ValueError(f"must be {self.expected()}")


def kind_of(annotation: Any, field_name: str) -> ValueKind:
    """The ValueKind of a field annotated ``Annotated[T | None, Meta(...), Hook(...)]``."""
    extras: tuple[Any, ...] = ()
    inner = annotation
    if typing.get_origin(inner) is Annotated:
        inner, *rest = typing.get_args(inner)
        extras = tuple(rest)
    optional = False
    if typing.get_origin(inner) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(inner) if a is not type(None)]
        optional = len(args) != len(typing.get_args(inner))
        (inner,) = args
    hook = next((e for e in extras if isinstance(e, Hook)), None)
    meta = next((e for e in extras if isinstance(e, msgspec.Meta)), None)
    base = inner
    if hook is not None and typing.get_origin(base) is tuple:
        base = tuple
    # msgspec sees the value type with its constraints (and None when optional).
    checked: Any = Annotated[inner, meta] if meta is not None else inner
    if optional:
        checked = checked | None
    return ValueKind(
        annotation=checked,
        base=base,
        optional=optional,
        hook=hook,
        meta=meta,
        unit_seconds=inner is float and field_name.endswith("_s"),
    )
