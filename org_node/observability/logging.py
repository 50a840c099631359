"""Structured logs: one JSON object per line, with run/round/stage/peer fields and a
correlation id that every org computes alike.

The correlation id of a stage is derived, not issued:
``SHA-256("fedweave-correlation/v1" 0 federation 0 run_key 0 round 0 stage)`` cut to
16 bytes of hex. Every org of a federation knows the four inputs, so the lines that
three orgs log about stage ``share`` of round 7 carry the same id, and an operator
can join the logs of several orgs on it without any coordination
(:func:`correlation_id`).

:class:`JsonFormatter` writes any :class:`logging.LogRecord` as such a line; the
structured fields are passed through ``extra=`` (see :data:`FIELDS`) or added by
:class:`ContextAdapter`. :func:`configure_json_logging` installs it on a logger.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Mapping, MutableMapping
from datetime import UTC, datetime
from typing import IO, Any

__all__ = [
    "FIELDS",
    "ContextAdapter",
    "JsonFormatter",
    "configure_json_logging",
    "correlation_id",
]

FIELDS: tuple[str, ...] = (
    "org",
    "federation",
    "run",
    "round",
    "stage",
    "peer",
    "event",
    "seconds",
    "bytes",
    "detail",
    "correlation_id",
)
"""Structured fields a log line may carry (from ``extra=``), in output order."""

_DOMAIN = b"fedweave-correlation/v1"


def correlation_id(federation: str, run_key: str, round: int, stage: str = "") -> str:
    """The id every org computes for ``stage`` of ``round`` of ``run_key`` (32 hex chars).

    An empty ``stage`` names the whole round. Fields are NUL-separated, so no two
    different tuples share an input.
    """
    if not isinstance(round, int) or isinstance(round, bool):
        raise TypeError(f"round must be an int, got {type(round).__name__}")
    try:
        fields = [federation.encode(), run_key.encode(), str(round).encode(), stage.encode()]
    except UnicodeEncodeError as exc:
        raise ValueError(f"correlation fields must be valid text: {exc.reason}") from None
    parts = [_DOMAIN, *fields]
    for part in parts[1:]:
        if b"\x00" in part:
            raise ValueError("correlation fields must not contain NUL")
    return hashlib.sha256(b"\x00".join(parts)).hexdigest()[:32]


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: ``ts``, ``level``, ``logger``, ``message``,
    the structured :data:`FIELDS` present on the record, and ``exc`` for exceptions.

    When a record has ``federation``, ``run`` and ``round`` but no
    ``correlation_id``, the id is derived (:func:`correlation_id`).
    """

    def __init__(self, static: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})
        unknown = set(self.static) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown static log fields: {sorted(unknown)}")

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = dict(self.static)
        for name in FIELDS:
            if name in record.__dict__ and record.__dict__[name] is not None:
                fields[name] = record.__dict__[name]
        if (
            "correlation_id" not in fields
            and isinstance(fields.get("round"), int)
            and "run" in fields
        ):
            fields["correlation_id"] = correlation_id(
                str(fields.get("federation", "")),
                str(fields["run"]),
                int(fields["round"]),
                str(fields.get("stage", "")),
            )
        for name in FIELDS:
            if name in fields:
                line[name] = fields[name]
        if record.exc_info and record.exc_info[0] is not None:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str, ensure_ascii=False)


class ContextAdapter(logging.LoggerAdapter[logging.Logger]):
    """A logger adapter adding fixed structured fields (org, run …) to every line;
    fields given per call in ``extra=`` win."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        kwargs["extra"] = extra
        return msg, kwargs


def configure_json_logging(
    logger: logging.Logger | str | None = None,
    *,
    stream: IO[str] | None = None,
    level: int = logging.INFO,
    static: Mapping[str, Any] | None = None,
) -> logging.Handler:
    """Send ``logger``'s records (the root logger by default) to ``stream`` (stderr) as
    JSON lines; returns the handler so that a caller can remove it again."""
    target = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(static))
    handler.setLevel(level)
    target.addHandler(handler)
    if target.level == logging.NOTSET or target.level > level:
        target.setLevel(level)
    return handler
