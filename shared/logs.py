"""Structured logging: JSON (or key=value) lines that carry the current trace and span ids."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import msgspec
from opentelemetry import trace

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_FIELDS = "structured_fields"  # the record attribute that holds a StructuredLogger call's keyword fields
_JSON = msgspec.json.Encoder(enc_hook=str)  # values JSON lacks (paths, exceptions, ...) as their text


class _Formatter(logging.Formatter):
    def __init__(self, fmt: str, service: str) -> None:
        super().__init__()
        self._json = fmt == "json"
        self._service = service
        self._second = -1  # the second whose timestamp text is cached (one strftime a second, not a line)
        self._second_text = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second, self._second_text = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        fields: dict[str, Any] = {
            "ts": f"{self._second_text}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            fields["trace_id"] = format(span.trace_id, "032x")
            fields["span_id"] = format(span.span_id, "016x")
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key != _FIELDS and not key.startswith("_"):
                fields[key] = value  # `extra=` of other libraries' calls
        fields.update(getattr(record, _FIELDS, None) or {})
        if record.exc_info:
            fields["error"] = self.formatException(record.exc_info)
        if self._json:
            return _JSON.encode(fields).decode()
        head = f"{fields.pop('ts')} {fields.pop('level'):<7} {fields.pop('msg')}"
        rest = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("service", "logger"))
        return f"{head} {rest}".rstrip()


class StructuredLogger(logging.LoggerAdapter[logging.Logger]):
    """`log.info("msg", key=value, ...)`: keyword arguments become structured fields."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        # kept apart from the record's own attributes, so any name works (`process=`, `name=`, ...)
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("exc_info", "stack_info", "stacklevel")}
        kwargs["extra"] = {_FIELDS: fields}
        return msg, kwargs


def get_logger(name: str) -> StructuredLogger:
    """A logger whose keyword arguments are emitted as fields."""
    return StructuredLogger(logging.getLogger(name), {})


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to sys.stderr as it is when a record comes: a command run in-process (tests, embedding programs) may
    see its caller replace and close the stream that was sys.stderr when logging was set up."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass  # StreamHandler's own assignment: the stream is always the current sys.stderr


def setup_logging(service: str, level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once per process: to stderr, JSON or text, with trace ids."""
    handler = _Stderr()
    handler.setFormatter(_Formatter(fmt, service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


class Sparse:
    """Whether to log now: once per `key` per `every_s` seconds (a flood of the same refusal logs a line per
    interval with how many were not logged; metrics count every one)."""

    def __init__(self, every_s: float = 10.0, max_keys: int = 10_000) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}  # key: (when last logged, how many skipped since)

    def due(self, key: str) -> int | None:
        """None to stay quiet; else how many were skipped since the last line (log it now)."""
        now = time.monotonic()
        last, skipped = self._last.get(key, (-self.every_s, 0))
        if now - last < self.every_s:
            self._last[key] = (last, skipped + 1)
            return None
        if len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = (now, 0)
        return skipped
