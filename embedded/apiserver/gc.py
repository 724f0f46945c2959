"""Garbage collection and namespace deletion, as background controllers over the store.

- ownerReferences: a dependent whose owners are all gone is deleted (background cascade); an
  owner being deleted in the foreground (`foregroundDeletion` finalizer) has its dependents
  deleted first and loses the finalizer when none remain; an `orphan` finalizer strips the
  owner's references from its dependents instead.
- namespaces: a namespace with a deletionTimestamp has everything in it deleted (honouring
  their finalizers), then its `kubernetes` finalizer removed, then it is gone.
- pods bound to a node that does not exist are deleted (the pod GC controller's orphan cleanup),
  and pods whose grace period ran out on a node whose kubelet never finished them are removed.

Sweeps run on a task woken by relevant changes; each sweep is one pass over the objects. A new
object with owners is the common case (a controller creating what it owns) and the only thing it can
need is deletion when no owner is left; it is checked alone, against a uid index kept from the
store's changes (verified against the store), and a full sweep runs only if an owner is missing.
A burst of N owned creates thus costs N lookups, not N passes over everything. Deletions are checked
alone too: an object deleted has only its dependents looked at (an index of dependents by owner uid,
each deleted in the background when no owner is left), and a pod marked for deletion only itself (the
pod rules below); a namespace, a `foregroundDeletion` or `orphan` finalizer, a dependent whose owner is
deleting, or changed ownerReferences still take a full sweep. A wave of N pods deleted thus costs N
lookups, not 3N passes over everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from typing import Any

from embedded.apiserver import errors
from embedded.apiserver.core import Core, meta
from embedded.apiserver.storage import Change, ObjKey, ResKey

NAMESPACES: ResKey = ("", "namespaces")
MAX_PENDING_NEW = 10_000
PODS: ResKey = ("", "pods")
NODES: ResKey = ("", "nodes")
GC_FINALIZERS = ("foregroundDeletion", "orphan")
Ref = tuple[ResKey, ObjKey]


class GarbageCollector:
    def __init__(self, core: Core, pod_grace_expiry: bool = True, namespace_delay: float = 0.5) -> None:
        self.core = core
        self.pod_grace_expiry = pod_grace_expiry
        # The namespace controller acts a moment after the deletion, as upstream's does (so that
        # `kubectl delete -f` of a namespace and its content finds the content still there).
        self.namespace_delay = namespace_delay
        self._ns_seen: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._full = False  # a change that needs a full sweep (else only `_new` are checked)
        self._new: list[Ref] = []  # objects created with ownerReferences
        self._orphans: list[Ref] = []  # dependents of an object deleted (checked alone)
        self._pods: list[ObjKey] = []  # pods marked for deletion (checked alone)
        self._uids: dict[str, Ref] = {}  # a hint; what it points to is checked
        self._dependents: dict[str, set[Ref]] = {}  # owner uid -> objects that name it (a hint, checked too)
        for res in core.store.resources():
            for key, obj in core.store.items(res):
                self._index(res, key, obj)
                self._refer(res, key, obj, 1)
        self._task: asyncio.Task[None] | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        core.store.add_listener(self._on_change)

    def wake(self) -> None:
        """Run a full sweep soon."""
        self._full = True
        self._wake.set()
        self.idle.clear()

    def _index(self, res: ResKey, key: ObjKey, obj: dict[str, Any]) -> None:
        uid = meta(obj).get("uid")
        if uid:
            self._uids[uid] = (res, key)

    def _refer(self, res: ResKey, key: ObjKey, obj: dict[str, Any] | None, sign: int) -> None:
        """Add (sign 1) or drop (-1) `obj` as a dependent of each owner it names."""
        for ref in meta(obj).get("ownerReferences") or [] if obj is not None else []:
            uid = ref.get("uid", "")
            if sign > 0:
                self._dependents.setdefault(uid, set()).add((res, key))
            elif (deps := self._dependents.get(uid)) is not None:
                deps.discard((res, key))
                if not deps:
                    del self._dependents[uid]

    def _light(self) -> None:
        self._wake.set()
        self.idle.clear()

    def _on_change(self, change: Change) -> None:
        md = meta(change.obj)
        refs_changed = change.prev is not None and (
            meta(change.prev).get("ownerReferences") != md.get("ownerReferences")
        )
        if change.type == "DELETED" or refs_changed:
            self._refer(change.res, change.key, change.prev if refs_changed else change.obj, -1)
        if change.type != "DELETED" and (change.type == "ADDED" or refs_changed):
            self._refer(change.res, change.key, change.obj, 1)
        if change.type == "DELETED":
            if md.get("uid"):
                self._uids.pop(md["uid"], None)
        else:
            self._index(change.res, change.key, change.obj)
        if change.type == "DELETED":
            if change.res in (NAMESPACES, NODES) or self._owner_deleting(md) or self._namespace_ending(change.key):
                # a namespace's end or its content's; a node's pods; an owner deleting may be done waiting
                self.wake()
                return
            deps = self._dependents.pop(md.get("uid", ""), None)
            if deps:
                self._orphans.extend(deps)
                self._light()
        elif md.get("deletionTimestamp"):
            if change.res == NAMESPACES or any(f in GC_FINALIZERS for f in md.get("finalizers") or []):
                self.wake()
            elif change.res == PODS:
                self._pods.append(change.key)
                self._light()
            elif refs_changed:
                self.wake()
        elif change.type == "ADDED" and md.get("ownerReferences"):
            if len(self._new) >= MAX_PENDING_NEW:  # not swept for long (not started?): one full sweep will do
                self._new.clear()
                self.wake()
                return
            self._new.append((change.res, change.key))
            self._wake.set()
            self.idle.clear()
        elif (
            change.type == "MODIFIED"
            and change.prev is not None
            and (meta(change.prev).get("ownerReferences") != md.get("ownerReferences"))
        ):
            self.wake()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="apiserver-gc")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _namespace_ending(self, key: ObjKey) -> bool:
        ns = self.core.store.get(NAMESPACES, ("", key[0])) if key[0] else None
        return ns is not None and bool(meta(ns).get("deletionTimestamp"))

    def _owner(self, ref: dict[str, Any]) -> dict[str, Any]:
        """The metadata of the object an ownerReference names, found through the uid index and verified by its
        uid ({} when it is gone, or another object now has that name)."""
        where = self._uids.get(ref.get("uid", ""))
        owner = self.core.store.get(*where) if where is not None else None
        omd = meta(owner) if owner is not None else {}
        return omd if omd.get("uid") == ref.get("uid") else {}

    def _owner_deleting(self, md: dict[str, Any]) -> bool:
        """Whether an owner the object names is itself being deleted (it may wait for its dependents)."""
        return any(self._owner(ref).get("deletionTimestamp") for ref in md.get("ownerReferences") or [])

    def _checked_alone(self) -> bool:
        """Pods marked for deletion and dependents of deleted objects, each looked at alone: True when one
        needs a full sweep (an owner of it deleting in the foreground)."""
        pods, self._pods = self._pods, []
        for key in pods:
            pod = self.core.store.get(PODS, key)
            if pod is not None:
                self._pod(key, pod)
        orphans, self._orphans = self._orphans, []
        for res, key in orphans:
            obj = self.core.store.get(res, key)
            if obj is None:
                continue
            refs = meta(obj).get("ownerReferences") or []
            solid = not refs  # its references were dropped meanwhile (an orphan finalizer): not ours to delete
            for ref in refs:
                omd = self._owner(ref)
                if not omd:
                    continue  # gone (or another object by that name)
                if _waits_for_dependents(omd):
                    return True  # it waits for this one: the sweep decides how it goes
                solid = True
            if not solid:
                self._delete(res, key, None)
        return False

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except TimeoutError:
                if self.pod_grace_expiry and self._expired_pods():
                    self.wake()
                continue
            self._wake.clear()
            if self._checked_alone():
                self._full = True
            if not self._full and not self._orphans_among_new():
                if not self._wake.is_set():
                    self.idle.set()
                continue
            self._full = False
            self._new.clear()
            for _ in range(100):
                if not self.sweep():
                    break
                await asyncio.sleep(0)
            if not self._wake.is_set():
                self.idle.set()

    def _orphans_among_new(self) -> bool:
        """Whether an object created with owners since the last look has no solid owner left."""
        new, self._new = self._new, []
        store = self.core.store
        for res, key in new:
            obj = store.get(res, key)
            if obj is None:
                continue
            for ref in meta(obj).get("ownerReferences") or []:
                omd = self._owner(ref)
                if omd and not _waits_for_dependents(omd):
                    break  # a solid owner: nothing to do for this object
            else:
                return True
        return False

    # ---- one pass

    def sweep(self) -> bool:
        """One pass; True when it changed something (so another pass may be needed)."""
        store = self.core.store
        by_uid: dict[str, tuple[ResKey, ObjKey, dict[str, Any]]] = {}
        dependents: dict[str, list[tuple[ResKey, ObjKey, dict[str, Any]]]] = {}
        everything = []
        for res in store.resources():
            for key, obj in store.items(res):
                md = meta(obj)
                everything.append((res, key, obj))
                if md.get("uid"):
                    by_uid[md["uid"]] = (res, key, obj)
                for ref in md.get("ownerReferences") or []:
                    dependents.setdefault(ref.get("uid", ""), []).append((res, key, obj))
        changed = False
        for res, key, obj in everything:
            md = meta(obj)
            if res == NAMESPACES and md.get("deletionTimestamp"):
                changed |= self._finish_namespace(key, obj)
                continue
            refs = md.get("ownerReferences") or []
            if refs:
                changed |= self._dependent(res, key, obj, refs, by_uid, bool(dependents.get(md.get("uid", ""))))
            if md.get("deletionTimestamp"):
                finalizers = md.get("finalizers") or []
                uid = md.get("uid", "")
                if "foregroundDeletion" in finalizers and not dependents.get(uid):
                    self._remove_finalizer(res, key, "foregroundDeletion")
                    changed = True
                if "orphan" in finalizers:
                    for d_res, d_key, d_obj in dependents.get(uid, []):
                        self._drop_ref(d_res, d_key, d_obj, uid)
                    self._remove_finalizer(res, key, "orphan")
                    changed = True
            if res == ("", "pods"):
                changed |= self._pod(key, obj)
        return changed

    def _dependent(
        self,
        res: ResKey,
        key: ObjKey,
        obj: dict[str, Any],
        refs: list[dict[str, Any]],
        by_uid: dict[str, tuple[ResKey, ObjKey, dict[str, Any]]],
        has_dependents: bool,
    ) -> bool:
        """Delete a dependent with no solid owner left (owners gone or deleting in the foreground).

        Like upstream, it is itself deleted in the foreground only when an owner waits for it and it has
        dependents of its own; otherwise in the background."""
        owners = [by_uid.get(ref.get("uid", "")) for ref in refs]
        waiting = False
        for owner in owners:
            if owner is None:
                continue
            if _waits_for_dependents(meta(owner[2])):
                waiting = True
            else:
                return False  # a solid owner remains
        return self._delete(res, key, "Foreground" if waiting and has_dependents else None)

    def _delete(self, res_key: ResKey, key: ObjKey, propagation: str | None) -> bool:
        res = self.core.registry.by_key(*res_key)
        obj = self.core.store.get(res_key, key)
        if res is None or obj is None:
            return False
        md = meta(obj)
        if md.get("deletionTimestamp") and (
            propagation != "Foreground" or "foregroundDeletion" in (md.get("finalizers") or [])
        ):
            return False
        try:
            self.core.delete(res, key[0], key[1], propagation)
        except errors.ApiError:
            return False
        return True

    def _remove_finalizer(self, res_key: ResKey, key: ObjKey, finalizer: str) -> None:
        res = self.core.registry.by_key(*res_key)
        if res is not None:
            self.core.remove_finalizer(res, key, finalizer)

    def _drop_ref(self, res_key: ResKey, key: ObjKey, obj: dict[str, Any], uid: str) -> None:
        md = meta(obj)
        refs = [r for r in md.get("ownerReferences") or [] if r.get("uid") != uid]
        new_md = {**md, "ownerReferences": refs}
        if not refs:
            new_md.pop("ownerReferences")
        self.core.store.put(res_key, key, {**obj, "metadata": new_md})

    def _finish_namespace(self, key: ObjKey, ns: dict[str, Any]) -> bool:
        name = key[1]
        loop = asyncio.get_running_loop()
        uid = meta(ns).get("uid", name)
        first = self._ns_seen.setdefault(uid, loop.time())
        if loop.time() - first < self.namespace_delay:
            loop.call_later(self.namespace_delay - (loop.time() - first) + 0.01, self.wake)
            return False
        content = self.core.store.in_namespace(name)
        changed = False
        if content:
            for res_key, obj_key, _ in content:
                changed |= self._delete(res_key, obj_key, "Background")
            return changed
        spec = ns.get("spec") or {}
        if "kubernetes" in (spec.get("finalizers") or []):
            finalizers = [f for f in spec["finalizers"] if f != "kubernetes"]
            ns = self.core.store.put(NAMESPACES, key, {**ns, "spec": {**spec, "finalizers": finalizers}})
            changed = True
        if not (ns.get("spec") or {}).get("finalizers") and not meta(ns).get("finalizers"):
            self.core.store.delete(NAMESPACES, key)
            self._ns_seen.pop(uid, None)
            changed = True
        return changed

    def _pod(self, key: ObjKey, pod: dict[str, Any]) -> bool:
        node = (pod.get("spec") or {}).get("nodeName")
        md = meta(pod)
        if not md.get("deletionTimestamp") or md.get("finalizers"):
            return False
        if node and self.core.store.get(("", "nodes"), ("", node)) is None:
            self.core.store.delete(("", "pods"), key)
            return True
        if self.pod_grace_expiry and _past(md.get("deletionTimestamp")):
            self.core.store.delete(("", "pods"), key)
            return True
        return False

    def _expired_pods(self) -> bool:
        for _, pod in self.core.store.items(("", "pods")):
            md = meta(pod)
            if (
                md.get("deletionTimestamp")
                and not md.get("finalizers")
                and md.get("deletionGracePeriodSeconds")
                and _past(md["deletionTimestamp"])
            ):
                return True
        return False


def _past(ts: str | None) -> bool:
    if not ts:
        return False
    try:
        when = dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    except ValueError:
        return False
    return when <= dt.datetime.now(dt.UTC)


def _waits_for_dependents(md: dict[str, Any]) -> bool:
    """Whether an owner (its metadata) is being deleted in the foreground: it waits for its dependents to go."""
    return bool(md.get("deletionTimestamp")) and "foregroundDeletion" in (md.get("finalizers") or [])
