"""The replay command: dead letters back to their source topics, as their producers sent them."""

from worker.replay.command import add_replay_parser, render, run_replay
from worker.replay.plan import DeadLetter, Entry, Filters, Outcome, Planner, ReplayPlan, parse_time
from worker.replay.transfer import ReplayError, replay

__all__ = [
    "DeadLetter",
    "Entry",
    "Filters",
    "Outcome",
    "Planner",
    "ReplayError",
    "ReplayPlan",
    "add_replay_parser",
    "parse_time",
    "render",
    "replay",
    "run_replay",
]
