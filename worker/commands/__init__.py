"""The commands beside ``run`` that reach Kafka as the worker does: produce, topics, tail."""

from worker.commands.produce import Outgoing, add_produce_parser, progress_bar, send_all
from worker.commands.session import CommandFailed, Connection, read_connection
from worker.commands.tail import add_tail_parser
from worker.commands.topics import add_topics_parser

__all__ = [
    "CommandFailed",
    "Connection",
    "Outgoing",
    "add_produce_parser",
    "add_tail_parser",
    "add_topics_parser",
    "progress_bar",
    "read_connection",
    "send_all",
]
