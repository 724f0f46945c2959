"""The Events a kubelet records about a pod's containers, with upstream's reasons and messages.

Owns the container lifecycle's Events (`Pulling`/`Pulled` as the image pull policy decides: images are never
pulled here, so an image is "already present" unless the policy is Always; `Created`, `Started`, `BackOff`,
`Killing`), each about the pod with the container's `fieldPath` (`spec.containers{name}`), from component
`kubelet` on this node, written one at a time in the order they happened (best effort: a failed write is
logged, as the kubelet's recorder drops it).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from shared.kube.events import EventType, event_body, record_event

COMPONENT = "kubelet"


def _field_path(pod: dict[str, Any], container: str) -> str:
    spec = pod.get("spec") or {}
    for key in ("initContainers", "containers", "ephemeralContainers"):
        if any(c.get("name") == container for c in spec.get(key) or []):
            return f"spec.{key}{{{container}}}"
    return f"spec.containers{{{container}}}"


def pull_events(image: str, policy: str) -> list[tuple[EventType, str, str]]:
    """What the image manager says before a container is created (no image is fetched here)."""
    if policy == "Always":
        return [
            ("Normal", "Pulling", f'Pulling image "{image}"'),
            (
                "Normal",
                "Pulled",
                f'Successfully pulled image "{image}" in 0s (0s including waiting). Image size: 0 bytes.',
            ),
        ]
    return [("Normal", "Pulled", f'Container image "{image}" already present on machine')]


class EventRecorder:
    """Container Events of this node's pods, written in order by one task."""

    def __init__(self, api: Any, node: str) -> None:
        self.api = api
        self.node = node
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def container(self, pod: dict[str, Any], container: str, type: EventType, reason: str, message: str) -> None:
        meta = pod["metadata"]
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta["uid"],
            "fieldPath": _field_path(pod, container),
        }
        self._queue.put_nowait(
            event_body(involved, reason=reason, message=message, type=type, component=COMPONENT, instance=self.node)
        )
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        while not self._queue.empty():
            await record_event(self.api, self._queue.get_nowait())

    async def close(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, 5)
