"""Triton's repository index read: versions a rollout may bring back, and versions retired."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker.flow.holds import NOT_LISTED, Listing
from worker.triton.repository import listing, merged, read_index

pytestmark = pytest.mark.timeout(10)

TRACE = "Internal: RuntimeError: cannot load\n\nAt:\n  /tmp/folder/2/model.py(19): initialize\n"


def index(*entries: tuple[str, str, str, str]) -> dict[str, dict[str, tuple[str, str]]]:
    """The index of these (name, version, state, reason) entries, as Triton's response has
    them."""
    models = [SimpleNamespace(name=n, version=v, state=s, reason=r) for n, v, s, r in entries]
    return read_index(models)


def test_a_model_never_loaded_or_absent_is_not_listed() -> None:
    """No state (in the repository, never loaded), or not in the index: not listed."""
    never = index(("mlp", "", "", ""))
    assert listing(never, "mlp", "") == NOT_LISTED
    assert listing(never, "other", "1") == NOT_LISTED


@pytest.mark.parametrize(
    ("states", "version"),
    [
        ({"1": "READY"}, "1"),
        ({"1": "UNAVAILABLE"}, "1"),  # the model unloaded: a rollout
        ({"1": "UNAVAILABLE", "2": "UNAVAILABLE"}, "2"),
        ({"1": "UNLOADING", "2": "LOADING"}, "1"),  # a new version loading, none ready yet
        ({"1": "LOADING", "2": "READY"}, "1"),  # a rollout loads it back
        ({"1": "UNAVAILABLE", "2": "READY"}, ""),  # any version: one serves
    ],
)
def test_a_version_a_rollout_may_bring_back_is_listed(states: dict[str, str], version: str) -> None:
    """Listed and not retired: its records wait for it."""
    found = index(*(("mlp", v, s, "unloaded") for v, s in states.items()))
    assert listing(found, "mlp", version) == Listing(listed=True)


def test_a_version_unloaded_while_another_serves_is_retired() -> None:
    """UNAVAILABLE (or UNLOADING) while another version is READY: retired, the sentence naming
    the version, its state and reason, and the versions served."""
    found = index(
        ("mlp", "1", "UNAVAILABLE", "unloaded"),
        ("mlp", "10", "READY", ""),
        ("mlp", "2", "READY", ""),
        ("mlp", "3", "UNLOADING", ""),
    )
    retired = listing(found, "mlp", "1")
    assert retired.listed
    assert retired.retired.startswith(
        "Triton lists model 'mlp' version 1 as UNAVAILABLE (unloaded) while version 2, 10 of it "
        "serves: retired by the model's version policy, or failed to load"
    ), retired.retired
    assert "version 3 as UNLOADING while" in listing(found, "mlp", "3").retired
    assert listing(found, "mlp", "9") == NOT_LISTED


def test_a_version_that_failed_to_load_names_the_first_line_of_the_reason() -> None:
    """A version whose load failed while another serves: retired; the reason's traceback is
    cut to its first line."""
    found = index(("mlp", "1", "READY", ""), ("mlp", "2", "UNAVAILABLE", TRACE))
    retired = listing(found, "mlp", "2").retired
    assert "as UNAVAILABLE (Internal: RuntimeError: cannot load) while version 1" in retired
    assert "model.py" not in retired


def test_several_endpoints_retire_a_version_only_when_none_may_serve_it() -> None:
    """merged: listed where one endpoint may serve the version; retired where none may and
    one says so; not listed where none lists it."""
    retired = Listing(listed=True, retired="retired there")
    assert merged([retired, Listing(listed=True)]) == Listing(listed=True)
    assert merged([NOT_LISTED, retired]) == retired
    assert merged([NOT_LISTED, NOT_LISTED]) == merged([]) == NOT_LISTED
