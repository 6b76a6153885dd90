"""The seeded chaos soak's pieces: traffic, producers, outcomes, processes, faults, the oracle.

The soak itself (tests/fault/test_soak.py) wires them together. Every random choice
comes from the soak's seed, so a failing run replays with SOAK_SEED.
"""

from tests.support.soak.chaos import Chaos
from tests.support.soak.lanes import AiokafkaLane, ConfluentLane, Inputs, LaneSpec, Ledger
from tests.support.soak.oracle import Figures
from tests.support.soak.outcomes import Collector
from tests.support.soak.processes import triton_model_call, triton_model_ready
from tests.support.soak.progress import OffsetReader, Progress
from tests.support.soak.schedule import FAULT_KINDS, FIRST_KINDS, schedule
from tests.support.soak.servers import Stack
from tests.support.soak.traffic import MODELS, OUTPUT_MAX_BYTES

__all__ = [
    "FAULT_KINDS",
    "FIRST_KINDS",
    "MODELS",
    "OUTPUT_MAX_BYTES",
    "AiokafkaLane",
    "Chaos",
    "Collector",
    "ConfluentLane",
    "Figures",
    "Inputs",
    "LaneSpec",
    "Ledger",
    "OffsetReader",
    "Progress",
    "Stack",
    "schedule",
    "triton_model_call",
    "triton_model_ready",
]
