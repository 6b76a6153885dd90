"""The soak's faults: which, in what order, how long apart and how long down, from the seed."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tests.support.soak.traffic import MODELS

FAULT_KINDS = (
    "worker_kill",  # SIGKILL the worker, start another
    "worker_stop",  # SIGTERM the worker (it drains), start another
    "triton_restart",  # stop both Triton endpoints, start them again
    "triton_kill",  # SIGKILL both Triton endpoints, start them again
    "endpoint_kill",  # SIGKILL one of the two Triton endpoints, start it again
    "model_reload",  # unload one model on both endpoints, load it again
    "broker_restart",  # stop the only broker, start it again
    "registry_restart",  # stop the Schema Registry, start it again
)
#: The kinds each delivery mode applies first, so that even a short run (CI's) has them:
#: what a SIGKILL redoes is the mode's own promise; exactly_once must also redo the
#: transactions a broker restart fails, at_least_once lose nothing to an endpoint's death.
FIRST_KINDS = {
    "at_least_once": ("worker_kill", "endpoint_kill"),
    "exactly_once": ("worker_kill", "broker_restart"),
}


#: About how long each kind takes to apply and recover from on the 2-core machine (the
#: Tritons load every model again after a restart): a run ends rather than start a fault
#: that would not end by its length.
TYPICAL_S = {
    "worker_kill": 6.0,
    "worker_stop": 3.0,
    "triton_restart": 20.0,
    "triton_kill": 10.0,
    "endpoint_kill": 8.0,
    "model_reload": 4.0,
    "broker_restart": 10.0,
    "registry_restart": 7.0,
}


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault: quiet time before it, its kind, how long the thing stays down,
    the model a reload picks and the endpoint an endpoint kill picks."""

    gap_s: float
    kind: str
    down_s: float
    model: str
    endpoint: int


def schedule(seed: int, first: Sequence[str] = ()) -> Iterator[Fault]:
    """Rounds of every fault kind in a seeded order (``first`` ones at the head of the first
    round, in a seeded order too), with seeded gaps, down times, models and endpoints."""
    rng = random.Random(seed)
    head = list(first)
    while True:
        rest = [k for k in FAULT_KINDS if k not in head]
        rng.shuffle(head)
        rng.shuffle(rest)
        for kind in head + rest:
            yield Fault(
                gap_s=round(rng.uniform(1.5, 4.0), 2),
                kind=kind,
                down_s=round(rng.uniform(0.0, 2.0), 2),
                model=rng.choice(MODELS),
                endpoint=rng.randrange(2),
            )
        head = []
