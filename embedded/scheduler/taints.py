"""Taints against tolerations, as kube-scheduler judges them, for a node's taints (nodefilter.py) and a device's
(allocator.py) alike: whether a toleration covers a taint, the first taint that keeps a pod or claim off, and a
taint as `kubectl describe` writes it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def tolerates(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("key") and t.get("key") != taint.get("key"):
            continue
        op = t.get("operator") or "Equal"
        if op == "Exists" or (op == "Equal" and (t.get("value") or "") == (taint.get("value") or "")):
            return True
    return False


def blocking_taint(
    taints: Iterable[Mapping[str, Any]], tolerations: Sequence[Mapping[str, Any]]
) -> Mapping[str, Any] | None:
    """The first NoSchedule or NoExecute taint that no toleration covers."""
    for taint in taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(taint, tolerations):
            return taint
    return None


def taint_text(taint: Mapping[str, Any]) -> str:
    value = taint.get("value") or ""
    return f"{taint.get('key')}{'=' + value if value else ''}:{taint.get('effect')}"
