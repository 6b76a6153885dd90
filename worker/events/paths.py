"""Where a value sits in an event: a JSON Pointer (``/features/3``) or a dotted path
(``$.features[3]``, ``features[3]``, ``customer.age``), parsed once into steps.

Messages always show a path in the dotted form (``$.features[3]``), whichever form the
mapping used, so a dead letter's message reads the same for every mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

__all__ = ["MISSING", "EventPath", "parse_path"]

#: What ``EventPath.find`` returns where the event has nothing.
MISSING: Final = object()

_DOTTED_STEP: Final = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")
_PLAIN_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


@dataclass(frozen=True, slots=True)
class EventPath:
    """A path into a JSON event: keys (str) and list indexes (int)."""

    steps: tuple[str | int, ...]

    def find(self, event: Any) -> Any:
        """The value at this path, or ``MISSING`` (a key absent, an index past the end, a
        step into something that is not an object or a list)."""
        node = event
        for step in self.steps:
            if isinstance(node, dict):
                node = node.get(step if isinstance(step, str) else str(step), MISSING)
            elif isinstance(node, list) and isinstance(step, int):
                node = node[step] if step < len(node) else MISSING
            elif isinstance(node, np.ndarray) and isinstance(step, int):
                # An Avro event's array of numbers (worker.registry.flat_avro).
                node = node[step].item() if step < len(node) else MISSING
            else:
                return MISSING
            if node is MISSING:
                return MISSING
        return node

    def __str__(self) -> str:
        parts = ["$"]
        for step in self.steps:
            if isinstance(step, int):
                parts.append(f"[{step}]")
            elif _PLAIN_NAME.fullmatch(step):
                parts.append(f".{step}")
            else:
                parts.append(f"[{step!r}]")
        return "".join(parts)

    def at(self, index: int) -> str:
        """This path's ``index``-th element, as shown in messages."""
        return f"{self}[{index}]"


def parse_path(text: str) -> EventPath:
    """Parse a JSON Pointer or a dotted path; ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a path such as '/features' or '$.features', got {text!r}")
    if text.startswith("/"):
        return EventPath(tuple(_pointer_step(part) for part in text[1:].split("/")))
    body = text[1:] if text.startswith("$") else text
    if body and not body.startswith((".", "[")):
        body = "." + body
    steps: list[str | int] = []
    position = 0
    while position < len(body):
        match = _DOTTED_STEP.match(body, position)
        if match is None or match.end() == position:
            raise ValueError(f"path {text!r}: cannot read it from {body[position:]!r} on")
        key, index = match.groups()
        steps.append(int(index) if index is not None else key)
        position = match.end()
    if not steps:
        raise ValueError(f"path {text!r} names the whole event; name a field in it")
    return EventPath(tuple(steps))


def _pointer_step(part: str) -> str | int:
    """One JSON Pointer reference token (RFC 6901): ``~1`` is ``/``, ``~0`` is ``~``."""
    token = part.replace("~1", "/").replace("~0", "~")
    return int(token) if token.isdigit() and (token == "0" or not token.startswith("0")) else token
