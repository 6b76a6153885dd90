"""The path of a record between the stages: a path chosen per record, the same steps on each.

``dispatch`` chooses; ``single`` runs a record in a task of its own, ``batch`` the plain
records of a pass together, ``stream`` a decoupled model's request; ``outcome`` is how a
record ends, where the paths meet; ``steps`` admit, encode and keep the books of every
outcome, for all of them.
"""

from worker.records.dispatch import Dispatcher, build_dispatcher
from worker.records.rules import RecordRules
from worker.records.steps import Steps

__all__ = ["Dispatcher", "RecordRules", "Steps", "build_dispatcher"]
