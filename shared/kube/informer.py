"""A generic informer: one resource's objects kept current by list + watch, for controllers.

Owns the cache of one resource keyed `(namespace, name)`, an index of the objects by their
controller owner's uid, and the list/watch loop: list, watch from the list's resourceVersion,
re-list on 410 Gone (at once) or on any other failure (after `retry_s`). Every change of the
cache calls `on_change(event, obj, old)` (event ADDED, MODIFIED or DELETED; on DELETED `obj` is
the last known object), synchronously, on the event loop.

Writers keep the cache ahead of the watch: `apply()` a write's answer so that the next reconcile
sees it at once, and `mark_deleted()` an object just deleted: it stays cached, but as deleting
(a deletionTimestamp), whatever lagging events say, until its DELETED event arrives. An event
older than the cached object (by resourceVersion) is ignored, so a lagging watch never undoes a
write.

`transform` (optional) cuts each object to what the owner reads before it is cached (as client-go's
SetTransform): a reader of a thousand nodes' slices keeps their few fields, not every attribute. It
must keep metadata name, namespace, uid, resourceVersion, deletionTimestamp and ownerReferences.

    pods = Informer(kube, PODS, on_change=handler)
    task = asyncio.create_task(pods.run(stopping))
    await pods.synced.wait()
    pods.owned_by(rs_uid)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp

from shared.kube.resources import Kube, Resource
from shared.kube.rest import ApiError, Gone
from shared.kube.timestamps import k8s_time
from shared.logs import get_logger
from shared.numbers import decimal_int

log = get_logger(__name__)
Obj = dict[str, Any]
Key = tuple[str, str]
Handler = Callable[[str, Obj, Obj | None], None]
Transform = Callable[[Obj], Obj]
TRANSIENT = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
TOMBSTONE_TTL_S = 300.0


def key_of(obj: Obj) -> Key:
    md = obj.get("metadata") or {}
    return str(md.get("namespace") or ""), str(md.get("name") or "")


def uid_of(obj: Obj | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("uid") or "")


def controller_of(obj: Obj | None) -> Obj | None:
    """The ownerReference with `controller: true`, if any."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def resource_version(obj: Obj) -> int | None:
    """The object's resourceVersion as a number (the embedded server's are), or None."""
    text = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return decimal_int(text)


async def until_synced(synced: Iterable[asyncio.Event], stopping: asyncio.Event) -> bool:
    """Wait until every informer has listed once (True), or until `stopping` is set first (False)."""
    listed: asyncio.Future[Any] = asyncio.gather(*(event.wait() for event in synced))
    stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([listed, stop], return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    listed.cancel()
    return not stopping.is_set()


def _deleting(obj: Obj) -> Obj:
    """obj as deleting: a copy with a deletionTimestamp (now), for an object we have just deleted."""
    return {**obj, "metadata": {**(obj.get("metadata") or {}), "deletionTimestamp": k8s_time()}}


class Informer:
    """The cached objects of one resource, kept current by `run()`."""

    def __init__(
        self,
        kube: Kube,
        res: Resource,
        on_change: Handler | None = None,
        watch_timeout_s: int = 300,
        retry_s: float = 1.0,
        transform: Transform | None = None,
        field_selector: str | None = None,
    ) -> None:
        self.kube = kube
        self.res = res
        self.field_selector = field_selector  # e.g. metadata.name=<node>: one object, not the whole kind
        self.on_change = on_change
        self.transform = transform
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.objects: dict[Key, Obj] = {}
        self.synced = asyncio.Event()  # listed at least once
        self.lists = 0  # full lists (1 + re-lists)
        self._owned: dict[str, set[Key]] = {}  # controller uid -> keys of its dependents
        self._gone: dict[str, float] = {}  # uids we deleted -> when; until their DELETED event

    # ---- reads -------------------------------------------------------------------------------------

    def get(self, namespace: str, name: str) -> Obj | None:
        return self.objects.get((namespace, name))

    def values(self, namespace: str | None = None) -> list[Obj]:
        return [o for (ns, _), o in self.objects.items() if namespace is None or ns == namespace]

    def owned_by(self, uid: str) -> list[Obj]:
        """Objects whose controller ownerReference has this uid."""
        return [self.objects[k] for k in self._owned.get(uid, ()) if k in self.objects]

    # ---- updates -----------------------------------------------------------------------------------

    def _index(self, key: Key, old: Obj | None, new: Obj | None) -> None:
        before, after = controller_of(old), controller_of(new)
        if before and (after is None or before.get("uid") != after.get("uid")):
            keys = self._owned.get(str(before.get("uid")))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._owned[str(before.get("uid"))]
        if after:
            self._owned.setdefault(str(after.get("uid")), set()).add(key)

    def _store(self, event: str, obj: Obj) -> Obj | bool | None:
        """Apply one event to the cache: the previous object (None if new), or False if nothing changed."""
        key, uid = key_of(obj), uid_of(obj)
        old = self.objects.get(key)
        if event == "DELETED":
            self._gone.pop(uid, None)
            if old is None or uid_of(old) != uid:
                return False  # gone already, or a deletion of an older incarnation
            del self.objects[key]
            self._index(key, old, None)
            return old
        if uid in self._gone and not (obj.get("metadata") or {}).get("deletionTimestamp"):
            obj = _deleting(obj)
        if old is not None and uid_of(old) == uid:
            new_rv, old_rv = resource_version(obj), resource_version(old)
            if new_rv is not None and old_rv is not None and new_rv <= old_rv:
                return False  # stale, or a write we applied already
        self.objects[key] = obj
        self._index(key, old, obj)
        return old

    def _notify(self, event: str, obj: Obj, old: Obj | None) -> None:
        if self.on_change is not None:
            self.on_change(event, obj, old)

    def apply(self, obj: Obj, event: str = "MODIFIED") -> None:
        """Apply a watch event or a write's answer (ADDED/MODIFIED/DELETED), notifying on a change."""
        if self.transform is not None:
            obj = self.transform(obj)
        old = self._store(event, obj)
        if old is False:
            return
        assert not isinstance(old, bool)
        if event == "DELETED":
            self._notify(event, old or obj, old)
        else:
            self._notify("MODIFIED" if old is not None else "ADDED", obj, old)

    def mark_deleted(self, obj: Obj) -> None:
        """We deleted `obj`: keep it cached as deleting until the deletion shows on the watch."""
        now = time.monotonic()
        self._gone = {u: t for u, t in self._gone.items() if now - t < TOMBSTONE_TTL_S}
        key, uid = key_of(obj), uid_of(obj)
        old = self.objects.get(key)
        if old is not None and uid_of(old) == uid:
            self._gone[uid] = now
            if not (old.get("metadata") or {}).get("deletionTimestamp"):
                self.objects[key] = _deleting(old)
                self._notify("MODIFIED", self.objects[key], old)

    def replace_all(self, items: list[Obj]) -> None:
        """A fresh list: notify what appeared, changed or disappeared since the cache was filled."""
        if self.transform is not None:
            items = [self.transform(o) for o in items]
        self._replace_all(items)

    def _replace_all(self, items: list[Obj]) -> None:
        fresh = {key_of(o): o for o in items}
        uids = {uid_of(o) for o in items}
        self._gone = {u: t for u, t in self._gone.items() if u in uids}
        for key in [k for k in self.objects if k not in fresh]:
            gone = self.objects.pop(key)
            self._index(key, gone, None)
            self._notify("DELETED", gone, gone)
        for key, obj in fresh.items():
            if uid_of(obj) in self._gone and not (obj.get("metadata") or {}).get("deletionTimestamp"):
                obj = _deleting(obj)
            old = self.objects.get(key)
            if old is not None and uid_of(old) == uid_of(obj) and resource_version(old) == resource_version(obj):
                continue
            self.objects[key] = obj
            self._index(key, old, obj)
            self._notify("MODIFIED" if old is not None else "ADDED", obj, old)

    # ---- the loop ----------------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """List, then watch, until `stopping` is set (or the task is cancelled)."""
        while not stopping.is_set():
            try:
                items, rv = await self.kube.list(self.res, transform=self.transform, field_selector=self.field_selector)
                self.lists += 1
                self._replace_all(items)
                self.synced.set()
                while not stopping.is_set():
                    async for event, obj in self.kube.watch(
                        self.res, rv, timeout_s=self.watch_timeout_s, field_selector=self.field_selector
                    ):
                        rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                        if event in ("ADDED", "MODIFIED", "DELETED"):
                            self.apply(obj, event)
            except Gone:
                log.info("watch expired; re-listing", resource=self.res.plural)
            except (ApiError, *TRANSIENT) as exc:
                log.warning(
                    "informer failed; re-listing", resource=self.res.plural, error=str(exc), retry_s=self.retry_s
                )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.retry_s)
