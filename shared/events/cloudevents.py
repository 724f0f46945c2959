"""CloudEvents attributes for every event we publish, per the CloudEvents NATS protocol binding
(binary content mode: the attributes as `ce-` headers, the body is the event's data as JSON).

A consumer written with any CloudEvents SDK reads our messages as CloudEvents; one that does not care
ignores the headers. Built from what the publish already has (no second encoding of the body):
`ce-id` is the event's own id where it has one (claim events' `event_id`), else the message id the
stream de-duplicates on; `ce-type` is `com.nvidia.gpu.dra.v1.<catalog entry>`; `ce-source` names the
publishing service; `ce-subject` is the NATS subject; `ce-time` is when the producer observed it.
"""

from __future__ import annotations

import datetime
import functools
import math

from shared.events.base import Message, now_unix
from shared.events.catalog import Entry

SPEC_VERSION = "1.0"
TYPE_PREFIX = "com.nvidia.gpu.dra"
CONTENT_TYPE = "application/json"


@functools.cache  # a catalog entry's type and a service's source never change: made once, not per event
def event_type(entry: Entry) -> str:
    """`com.nvidia.gpu.dra.<subject version>.<entry name>`, e.g. com.nvidia.gpu.dra.v1.claim-lifecycle."""
    version = entry.subject.split(".")[1]
    return f"{TYPE_PREFIX}.{version}.{entry.name}"


@functools.lru_cache(maxsize=64)
def source(publisher: str) -> str:
    """The CloudEvents source (a URI reference) of a publishing service, e.g. /gpu-dra/preparer-gpu-node-0."""
    return f"/gpu-dra/{publisher}"


def rfc3339(unix_s: float) -> str:
    """`2026-12-06T20:53:07.123456Z`: UTC, to the microsecond (rounded half to even, as datetime rounds)."""
    fraction, whole = math.modf(unix_s)  # split first, as datetime does: the microseconds of the fraction
    micros = round(fraction * 1e6)
    if micros >= 1_000_000:
        whole, micros = whole + 1, micros - 1_000_000
    elif micros < 0:
        whole, micros = whole - 1, micros + 1_000_000
    return f"{_second(int(whole))}.{micros:06d}Z"


@functools.lru_cache(maxsize=4)  # the events of one second share it: formatted once, not per event
def _second(unix_s: int) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")


def headers(entry: Entry, message: Message, subject: str, fallback_id: str, publisher: str) -> dict[str, str]:
    """The `ce-` headers (and content-type) of one event."""
    observed = getattr(message, "observed_at", 0.0) or now_unix()
    return {
        "ce-specversion": SPEC_VERSION,
        "ce-id": getattr(message, "event_id", "") or fallback_id,
        "ce-type": event_type(entry),
        "ce-source": source(publisher),
        "ce-subject": subject,
        "ce-time": rfc3339(observed),
        "content-type": CONTENT_TYPE,
    }
