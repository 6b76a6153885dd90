"""The few private parts of aiokafka the worker relies on, each in one function."""

from __future__ import annotations

from typing import Any

__all__ = ["in_transaction"]


def in_transaction(producer: Any) -> bool:
    """True while a transactional producer has a transaction open (aiokafka has no public
    way to ask, and ``abort_transaction`` outside one raises)."""
    manager = producer._txn_manager
    return manager is not None and bool(manager.is_in_transaction())
