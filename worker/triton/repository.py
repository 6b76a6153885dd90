"""Triton's repository index read for the worker: which model versions may be served (again).

The index lists every model of the repository and, for each version Triton has loaded
or tried to load, its state (``READY``, ``LOADING``, ``UNLOADING``, ``UNAVAILABLE``) and
a reason (``unloaded``, or why its load failed). A version listed so exists, and a rollout
may bring it back: its records are held (``worker.flow.holds``). Not one that is
``UNLOADING`` or ``UNAVAILABLE`` while another version of its model is ``READY``: the
model is served, that version is not; its version policy retired it, or it failed to
load while the others loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from worker.flow.holds import NOT_LISTED, Listing

__all__ = ["SERVABLE_STATES", "Index", "listing", "merged", "read_index"]

#: Repository states of a model that Triton serves, or passes through in a rollout.
SERVABLE_STATES = frozenset({"READY", "LOADING", "UNLOADING", "UNAVAILABLE"})
#: States of a version that is not served (nor about to be).
_GONE_STATES = frozenset({"UNLOADING", "UNAVAILABLE"})
#: Triton's reason can hold a traceback: its first line, this long at most, is enough.
_MAX_REASON_CHARS = 200

#: Model name -> version -> (state, reason), for the versions in a servable state.
Index = dict[str, dict[str, tuple[str, str]]]


def read_index(models: Iterable[Any]) -> Index:
    """The index's entries (``RepositoryIndexResponse.models``) by model and version."""
    index: Index = {}
    for model in models:
        if model.state in SERVABLE_STATES:
            index.setdefault(model.name, {})[model.version] = (model.state, model.reason)
    return index


def listing(index: Index, name: str, version: str) -> Listing:
    """What ``index`` says of ``name`` at ``version`` ("": any version)."""
    versions = index.get(name)
    if not versions:
        return NOT_LISTED
    if not version:
        return Listing(listed=True)
    entry = versions.get(version)
    if entry is None:
        return NOT_LISTED
    state, reason = entry
    serving = sorted((v for v, (s, _) in versions.items() if s == "READY"), key=_number)
    if state not in _GONE_STATES or not serving:
        return Listing(listed=True)
    why = (reason.strip().splitlines() or [""])[0][:_MAX_REASON_CHARS]
    return Listing(
        listed=True,
        retired=(
            f"Triton lists model {name!r} version {version} as {state}"
            f"{f' ({why})' if why else ''} while version {', '.join(serving)} of it "
            "serves: retired by the model's version policy, or failed to load; name a "
            "version it serves (or none), or load this one"
        ),
    )


def merged(listings: Iterable[Listing]) -> Listing:
    """One listing of several Tritons' (endpoints'): listed where one may serve the version;
    retired only where none may and one says why."""
    found = list(listings)
    servable = [f for f in found if f.listed and not f.retired]
    return (servable or [f for f in found if f.retired] or [NOT_LISTED])[0]


def _number(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (0, version)
