"""Log output of ``kvrouter serve``: ``server.log_format`` ``text`` or ``json``.

:func:`configure` sets up the process's root logger; :func:`uvicorn_log_config` gives uvicorn
the same format, so every line of a router process has one shape. A record may carry
structured ``fields`` (``logger.info("request", extra={"fields": {...}})``, as the access lines
of router/access.py do): the JSON format puts them at the top level of the line's object, the
text format appends them as ``key=value``.

JSON lines have ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``msg``, the
record's fields, and ``exc`` (the traceback) when there is one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

__all__ = ["JsonFormatter", "TextFormatter", "configure", "uvicorn_log_config"]

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_enc = msgspec.json.Encoder(enc_hook=repr)
"""``repr``: a field value JSON has no type for (an exception, a path) is still logged."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        return _enc.encode(doc).decode()


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message>`` and the record's fields as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            tail = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
            head, sep, rest = line.partition("\n")  # a traceback stays after the fields
            line = f"{head} {tail}{sep}{rest}"
        return line


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def _level(level: str) -> str:
    return "DEBUG" if level.lower() == "trace" else level.upper()


def configure(level: str, fmt: str) -> None:
    """The root logger at ``level`` (``server.log_level``) writing ``fmt`` lines to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(_level(level))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per worker poll otherwise


def uvicorn_log_config(fmt: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for ``uvicorn.Config(log_config=...)``: uvicorn's
    loggers write ``fmt`` lines to stderr (uvicorn sets their levels from its ``log_level``)."""
    cls = JsonFormatter if fmt == "json" else TextFormatter
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"kvrouter": {"()": f"{__name__}.{cls.__name__}"}},
        "handlers": {
            "kvrouter": {
                "class": "logging.StreamHandler",
                "formatter": "kvrouter",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["kvrouter"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["kvrouter"], "level": "INFO", "propagate": False},
        },
    }
