"""Structured logs: structlog configured once; ours and the libraries' through one handler.

Lines are JSON (or console text on a terminal), with the contextvars bound by the
caller (topic, partition, offset, request id).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import orjson
import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

#: Libraries whose own stdlib logging is kept at WARNING whatever the worker's level.
THIRD_PARTY_LOGGERS = (
    "aiokafka",
    "kafka",
    "librdkafka",
    "tritonclient",
    "grpc",
    "asyncio",
    "urllib3",
)

#: Fields that ``worker.kafka.rdkafka.log`` passes as a stdlib record's ``extra``.
_EXTRA_FIELDS = ("facility", "client", "detail", "code", "fatal", "repeated")


class _WorkerLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one handler `configure_logging` installs; its type lets a reset find it."""


def _orjson_dumps(obj: Any, **kwargs: Any) -> str:
    return orjson.dumps(obj, default=kwargs.get("default"), option=orjson.OPT_NON_STR_KEYS).decode()


def configure_logging(log_format: str, level: str, *, stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) as JSON lines or console text.

    Calling it again replaces the previous configuration.
    """
    if log_format not in ("json", "console"):
        raise ValueError(f"log_format must be json or console, got {log_format!r}")
    if level not in _LEVELS:
        raise ValueError(f"level must be one of {', '.join(_LEVELS)}, got {level!r}")
    reset_logging()
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    target = stream if stream is not None else sys.stderr
    renderer: list[structlog.typing.Processor]
    if log_format == "json":
        # Tracebacks become one escaped string, so an error stays one line.
        renderer = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=target.isatty())]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # Not cached: module-level loggers must follow a reconfiguration (tests do it);
        # the hot path does not log, so the lookup cost does not matter.
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder(allow=_EXTRA_FIELDS)],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _WorkerLogHandler(target)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(max(_LEVELS[level], logging.WARNING))


def reset_logging() -> None:
    """Undo `configure_logging`: structlog defaults, our handler removed, levels unset."""
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _WorkerLogHandler)]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.WARNING)
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
