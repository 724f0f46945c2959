"""NodeConfig objects (the `nodeconfigs.resource.nvidia.com` CRD) -> the publisher's sharing config, live.

Owns the objects' status and Events; the watch, each object's verdict and the merged config are
`shared.nodeconfig_objects`'. A change takes effect at once, event-driven: the publisher gets
`on_config(old, new)` and re-publishes the slices of the nodes whose GPU settings differ (new
allocations see them; existing allocations and claims are never touched).

Each object is validated on its own (shared.nodeconfig): a bad one is refused (status `Accepted=False`, reason
InvalidNodeConfig, the message naming the field; a Warning Event InvalidNodeConfig on the object) and its last accepted
version stays in force (none if it never had one). A deleted object's rules go.

`--node-config FILE` is exclusive with this: given, the file is the whole config and NodeConfig
objects are neither read nor written.

Status: only the replica that owns the object's name (rendezvous hashing, as for nodes) writes its
status (the status subresource, a merge patch) and Events, and only when the conditions differ from
what the object has (lastTransitionTime aside): our own writes and other replicas never make a loop.
An accepted generation gets `Accepted=True` with `Applied=True` once this replica's work queue has gone
idle after the change (its nodes' slices written; `Applied=Unknown` until then).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from shared import nodeconfig
from shared.kube.events import event_body, record_event
from shared.kube.timestamps import k8s_time
from shared.logs import get_logger
from shared.nodeconfig_objects import NODECONFIGS, NodeConfigObjects

log = get_logger(__name__)

COMPONENT = "gpu-dra-publisher"
INVALID = "InvalidNodeConfig"
ACCEPTED, APPLIED = "Accepted", "Applied"
STATUS_RETRY_S = 2.0
APPLY_WAIT_S = 10.0
Obj = dict[str, Any]


def _condition(type_: str, status: str, reason: str, message: str, generation: int, old: Obj | None) -> Obj:
    same = old is not None and old.get("status") == status
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "observedGeneration": generation,
        "lastTransitionTime": old.get("lastTransitionTime") if same and old else k8s_time(),
    }


def _differs(a: Obj | None, b: Obj) -> bool:
    keys = ("status", "reason", "message", "observedGeneration")
    return a is None or any(a.get(k) != b.get(k) for k in keys)


class NodeConfigWatch(NodeConfigObjects):
    """The merged config of every NodeConfig object (`config`, kept current by `run()`), and their status."""

    def __init__(
        self,
        api_client: Any,
        *,
        on_config: Callable[[nodeconfig.NodeConfig, nodeconfig.NodeConfig], None],
        owns: Callable[[str], bool],
        idle: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(api_client, on_config=on_config, who="the publisher")
        self.owns = owns
        self.idle = idle
        self.status_writes = 0
        self.events = 0
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()

    def verdict_changed(self, name: str) -> None:
        if name in self.verdicts:
            self.mark(name)
        else:
            self._dirty.discard(name)

    # ---- status ---------------------------------------------------------------------------------------
    def mark(self, name: str | None = None) -> None:
        """Have the status loop look at this object (every object when None)."""
        self._dirty |= {name} if name is not None else set(self.verdicts)
        self._wake.set()

    async def run_status(self) -> None:
        """Write the statuses (and Events) of the objects marked, one at a time."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            names, self._dirty = self._dirty, set()
            for name in sorted(names):
                try:
                    await self._reconcile(name)
                except Exception as exc:  # noqa: BLE001 - written again shortly
                    log.warning(
                        "NodeConfig status not written; retrying",
                        nodeconfig=name,
                        error=str(exc),
                        retry_s=STATUS_RETRY_S,
                    )
                    asyncio.get_running_loop().call_later(STATUS_RETRY_S, self.mark, name)

    async def _reconcile(self, name: str) -> None:
        if not self.owns(name) or name not in self.verdicts:
            return
        generation, error = self.verdicts[name]
        applied = True
        if not error:
            try:  # the nodes the change concerns were queued when it came: idle means their slices are written
                await asyncio.wait_for(self.idle(), APPLY_WAIT_S)
            except TimeoutError:
                applied = False
                asyncio.get_running_loop().call_later(STATUS_RETRY_S, self.mark, name)
            if self.verdicts.get(name) != (generation, error):
                return  # changed while waiting: marked again
        obj = self.informer.get("", name)
        if obj is None:
            return
        status = obj.get("status") or {}
        current = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}
        wanted: list[Obj] = []
        if error:
            kept = "its last accepted version stays in force" if name in self.accepted else "it adds no rules"
            wanted.append(_condition(ACCEPTED, "False", INVALID, f"{error}; {kept}", generation, current.get(ACCEPTED)))
        else:
            rules = len(self.accepted[name].spec.rules)
            wanted.append(
                _condition(ACCEPTED, "True", "Valid", f"{rules} rule(s) in force", generation, current.get(ACCEPTED))
            )
            wanted.append(
                _condition(
                    APPLIED,
                    "True",
                    "SlicesPublished",
                    "the slices of the nodes it concerns are re-published; new allocations use it",
                    generation,
                    current.get(APPLIED),
                )
                if applied
                else _condition(
                    APPLIED, "Unknown", "Publishing", "slices are being re-published", generation, current.get(APPLIED)
                )
            )
        changed = [c for c in wanted if _differs(current.get(c["type"]), c)]
        if not changed and status.get("observedGeneration") == generation:
            return
        conditions = {**current, **{c["type"]: c for c in changed}}
        patch = {"status": {"observedGeneration": generation, "conditions": list(conditions.values())}}
        answer = await self.kube.patch(NODECONFIGS, None, name, patch, subresource="status")
        self.status_writes += 1
        self.informer.apply(answer)
        if error and any(c["type"] == ACCEPTED for c in changed):
            involved = {
                "apiVersion": nodeconfig.API_VERSION,
                "kind": nodeconfig.KIND,
                "name": name,
                "uid": (obj.get("metadata") or {}).get("uid", ""),
            }
            body = event_body(
                involved,
                reason=INVALID,
                type="Warning",
                component=COMPONENT,
                message=f"NodeConfig {name} generation {generation} refused: {error}",
            )
            if await record_event(self.api, body):
                self.events += 1
