"""Logging setup: structlog, one event per line, human-readable (console) or JSON.

Logs go to stderr so that `pagedkv generate` can keep stdout for completions. Call
`configure_logging` once at process start (the CLI does); `get_logger` works before that too,
with structlog's defaults.
"""

from __future__ import annotations

import logging
import sys

import structlog

_format = "console"  # the format configure_logging last set: spawned workers log the same way

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def configure_logging(fmt: str = "console", level: str | int = "info") -> None:
    """Route structlog (and stdlib logging, e.g. aiohttp's) to stderr as ``fmt`` lines.

    fmt: "console" (aligned key=value, for people) or "json" (one JSON object per line, for log
    collectors). level: a name ("debug" .. "critical") or a logging level number.
    Raises ValueError for an unknown format or level.
    """
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {fmt!r}")
    if isinstance(level, str):
        if level.lower() not in _LEVELS:
            raise ValueError(f"log level must be one of {sorted(_LEVELS)}, got {level!r}")
        level = _LEVELS[level.lower()]
    global _format
    _format = fmt
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                # plain tracebacks: rich's, with every frame's locals (tensors), took tens of seconds
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                                   exception_formatter=structlog.dev.plain_traceback))
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.add_logger_name, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_logger_factory,
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging (aiohttp access log, asyncio) get the same format.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def get_logger(name: str):
    """A structlog logger whose events carry ``logger=name`` (lazy: configuring later still applies)."""
    return structlog.get_logger(name)


class _NamedPrintLogger(structlog.PrintLogger):
    """A PrintLogger that knows its name, for structlog.stdlib.add_logger_name."""

    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name


def _logger_factory(*args) -> _NamedPrintLogger:
    return _NamedPrintLogger(sys.stderr, args[0] if args else "")


if not structlog.is_configured():  # before configure_logging (e.g. the Python LLM API): stderr, info and up
    structlog.configure(logger_factory=_logger_factory, wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))


def current_format() -> str:
    """The format `configure_logging` last set ("console" before any call): a process it spawns logs alike."""
    return _format
