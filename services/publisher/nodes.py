"""The cluster's Nodes by name -> uid, kept current by LIST then WATCH (410 Gone: LIST again).

Owns only that map and the callback fired when a node appears, disappears or is re-created
(a new uid): the publisher needs the uid for owner references and deletes a gone node's slices.

Not shared.kube.informer on purpose: at fleet scale (1,000+ nodes, bench/publisher_bench.py) this
keeps two strings per node, decoded by msgspec straight from the pages (`limit=500` + `continue`),
where the informer keeps every Node object as a dict (tens of kB each, with its status and images).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from shared.backoff import Backoff
from shared.kube import rest as kube
from shared.logs import get_logger

log = get_logger(__name__)


class NodeMeta(msgspec.Struct):
    name: str = ""  # a BOOKMARK's object carries only its resourceVersion
    uid: str = ""
    resourceVersion: str = ""  # noqa: N815
    labels: dict[str, str] = msgspec.field(default_factory=dict)


class NodeView(msgspec.Struct):
    metadata: NodeMeta


class StatusView(msgspec.Struct):
    code: int = 0
    reason: str = ""
    message: str = ""


class NodeEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


_EVENT = msgspec.json.Decoder(NodeEvent)
_NODE = msgspec.json.Decoder(NodeView)
_STATUS = msgspec.json.Decoder(StatusView)


class NodeWatcher:
    """`uids[name]` for every Node; `on_change(name)` when one comes, goes or changes uid."""

    def __init__(self, api_client: object, on_change: Callable[[str], None], *, watch_timeout_s: int = 300) -> None:
        self.api = api_client
        self.on_change = on_change
        self.uids: dict[str, str] = {}
        self.labels: dict[str, dict[str, str]] = {}  # NodeConfig rules select nodes by label
        self.synced = asyncio.Event()
        self.relists = 0
        self._rv = ""
        self._watch_timeout_s = watch_timeout_s

    async def relist(self) -> None:
        nodes: dict[str, str] = {}
        labels: dict[str, dict[str, str]] = {}
        version = ""
        async for page in kube.list_pages(self.api, "/api/v1/nodes", NodeView):
            nodes.update({n.metadata.name: n.metadata.uid for n in page.items})
            labels.update({n.metadata.name: n.metadata.labels for n in page.items})
            version = version or page.metadata.resourceVersion
        self._rv = version
        changed = {
            n
            for n in set(nodes) | set(self.uids)
            if nodes.get(n) != self.uids.get(n) or labels.get(n) != self.labels.get(n)
        }
        self.uids = nodes
        self.labels = labels
        self.relists += 1
        self.synced.set()
        for name in sorted(changed):
            self.on_change(name)

    async def run(self) -> None:
        """LIST, then WATCH from the list's resourceVersion, forever."""
        backoff = Backoff(initial_s=0.2, cap_s=5.0)
        while True:
            try:
                if not self._rv:
                    await self.relist()
                await self._watch()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except kube.Gone as exc:
                log.info("node watch expired; listing again", reason=str(exc))
                self._rv = ""
            except Exception as exc:  # noqa: BLE001 - API server restarts and network blips
                delay = backoff.next()
                log.warning("node watch failed; retrying", error=str(exc), backoff_s=delay)
                await asyncio.sleep(delay)
                self._rv = ""

    async def _watch(self) -> None:
        async for line in kube.watch_lines(
            self.api, "/api/v1/nodes", resource_version=self._rv, timeout_s=self._watch_timeout_s
        ):
            event = _EVENT.decode(line)
            if event.type == "ERROR":
                status = _STATUS.decode(event.object)
                if status.code == 410:
                    raise kube.Gone(410, status.reason or "Expired", status.message or "watch expired")
                raise RuntimeError(f"node watch error {status.code}: {status.message}")
            node = _NODE.decode(event.object).metadata
            self._rv = node.resourceVersion or self._rv
            if event.type == "BOOKMARK":
                continue
            if event.type == "DELETED":
                self.labels.pop(node.name, None)
                if self.uids.pop(node.name, None) is not None:
                    self.on_change(node.name)
            elif self.uids.get(node.name) != node.uid or self.labels.get(node.name) != node.labels:
                self.uids[node.name] = node.uid
                self.labels[node.name] = node.labels
                self.on_change(node.name)
