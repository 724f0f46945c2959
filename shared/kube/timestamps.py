"""The one way to write a Kubernetes timestamp (`metav1.Time`): RFC 3339 in UTC, whole seconds."""

from __future__ import annotations

import time


def k8s_time(ts: float | None = None) -> str:
    """`ts` (seconds since the epoch; now when None) as `2026-12-03T06:00:00Z`."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if ts is None else ts))
