"""The NodeConfig objects of a cluster (`nodeconfigs.resource.nvidia.com`), read live into one merged config.

Owns the watch of every NodeConfig object (a shared.kube informer), each object's verdict (accepted,
or refused with the error naming the field) and the merged config (`shared.nodeconfig.merge`: a refused
object keeps its last accepted rules; a deleted object's rules go). A server that does not serve the
CRD (404), or denies reading it (403), has no objects: every GPU exclusive, asked again every
CRD_POLL_S. Readers: the publisher (which also writes the objects' status:
`services.publisher.nodeconfigs`) and the preparer (which applies a GPU's time-slice interval).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shared import nodeconfig
from shared.backoff import Backoff
from shared.kube.informer import Informer, key_of
from shared.kube.resources import Kube, Resource
from shared.kube.rest import ApiError
from shared.logs import get_logger

log = get_logger(__name__)

NODECONFIGS = Resource(nodeconfig.GROUP, nodeconfig.VERSION, "nodeconfigs", nodeconfig.KIND, namespaced=False)
CRD_POLL_S = 30.0
Obj = dict[str, Any]
OnConfig = Callable[[nodeconfig.NodeConfig, nodeconfig.NodeConfig], None]


def generation_of(obj: Obj) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 0)


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less if `stopping` is set first."""
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        pass


class NodeConfigObjects:
    """The merged config of every NodeConfig object (`config`), kept current by `run()`; `on_config(old,
    new)` after each change of it."""

    def __init__(self, api_client: Any, *, on_config: OnConfig | None = None, who: str = "this process") -> None:
        self.who = who  # named in the log when the objects cannot be read
        self.api = api_client
        self.kube = kube = Kube(api_client)
        self.informer = Informer(kube, NODECONFIGS, on_change=self._changed, retry_s=5.0)
        self.on_config = on_config
        self.config = nodeconfig.DEFAULT
        self.accepted: dict[str, nodeconfig.NodeConfig] = {}  # object -> its last accepted version
        self.verdicts: dict[str, tuple[int, str]] = {}  # object -> (generation, error; "" when accepted)
        self.ready = asyncio.Event()  # listed once, or the CRD is not served: `config` may be used

    async def run(self, stopping: asyncio.Event) -> None:
        """Until the CRD is served, poll for it (no objects meanwhile); then list and watch the objects."""
        backoff = Backoff(initial_s=0.2, cap_s=5.0)
        said = False
        while not stopping.is_set():
            try:
                await self.kube.list(NODECONFIGS, page_size=1)
                break
            except ApiError as exc:
                if exc.status not in (403, 404):
                    delay = backoff.next()
                    log.warning("reading NodeConfig objects failed; retrying", error=str(exc), retry_s=delay)
                    await pause(stopping, delay)
                    continue
                if not said:
                    said = True
                    log.warning(
                        "NodeConfig objects cannot be read; every GPU exclusive until they can",
                        reason="the CRD is not installed"
                        if exc.status == 404
                        else f"{self.who}'s role may not list nodeconfigs",
                        error=str(exc),
                        retry_s=CRD_POLL_S,
                    )
                self.ready.set()
                await pause(stopping, CRD_POLL_S)
            except Exception as exc:  # noqa: BLE001 - API server restarts and network blips
                delay = backoff.next()
                log.warning("reading NodeConfig objects failed; retrying", error=str(exc), retry_s=delay)
                await pause(stopping, delay)
        watch = asyncio.create_task(self.informer.run(stopping), name="nodeconfig-informer")
        try:
            await self.informer.synced.wait()
            self.ready.set()
            await watch
        finally:
            watch.cancel()

    def verdict_changed(self, name: str) -> None:
        """Called when an object's verdict may have changed (the publisher writes its status)."""

    def _changed(self, event: str, obj: Obj, _old: Obj | None) -> None:
        name = key_of(obj)[1]
        if event == "DELETED":
            self.accepted.pop(name, None)
            self.verdicts.pop(name, None)
            self.verdict_changed(name)
        else:
            generation = generation_of(obj)
            try:
                self.accepted[name] = nodeconfig.from_obj(obj)
                verdict = (generation, "")
            except nodeconfig.NodeConfigError as exc:
                verdict = (generation, str(exc))
            if self.verdicts.get(name) != verdict:
                self.verdicts[name] = verdict
                if verdict[1]:
                    log.warning(
                        "NodeConfig refused; its last accepted version stays in force",
                        nodeconfig=name,
                        generation=generation,
                        error=verdict[1],
                    )
                else:
                    log.info(
                        "NodeConfig accepted",
                        nodeconfig=name,
                        generation=generation,
                        rules=len(self.accepted[name].spec.rules),
                    )
            self.verdict_changed(name)
        merged = nodeconfig.merge(self.accepted)
        if merged != self.config:
            old, self.config = self.config, merged
            if self.on_config is not None:
                self.on_config(old, merged)
