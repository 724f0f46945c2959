"""The kubelet emulator's pod loop: prepare the claims of pods bound to this node, run them, unprepare.

Owns, for one node: watching its pods, checking each claim is allocated and reserved for the pod,
calling `NodePrepareResources` per driver through a DRA client, resolving the returned CDI ids into
what each container gets (recorded on the pod as an annotation `kubectl get -o yaml` shows), the
pod's Running/Ready status, and `NodeUnprepareResources` once the last pod using a claim is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from embedded.kubelet.client import Claim, PreparedDevice
from embedded.kubelet.client import PreparedClaim as KubeletPreparedClaim
from embedded.nodeagent.cdi_resolve import CdiResolutionError, load_specs, resolve
from shared.logs import get_logger

log = get_logger(__name__)
EDITS_ANNOTATION = "gpu.nvidia.com/container-edits"


class DraClient(Protocol):
    """The kubelet side of the DRA gRPC protocol for the drivers registered on this node."""

    def drivers(self) -> set[str]: ...

    async def prepare(self, driver: str, claims: list[Claim]) -> dict[str, KubeletPreparedClaim]: ...

    async def unprepare(self, driver: str, claims: list[Claim]) -> dict[str, str]: ...


class PrepareFailed(RuntimeError):
    pass


@dataclass
class PreparedClaim:
    ref: Claim
    drivers: set[str]
    devices: list[PreparedDevice]
    pods: set[str] = field(default_factory=set)  # pod uids using it


def claim_name_for(pod: dict[str, Any], entry: dict[str, Any]) -> str | None:
    """The ResourceClaim a pod's `spec.resourceClaims[]` entry refers to (None until generated)."""
    if entry.get("resourceClaimName"):
        return str(entry["resourceClaimName"])
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if status.get("name") == entry.get("name"):
            return status.get("resourceClaimName")
    return None


def container_edits(pod: dict[str, Any], prepared: dict[str, PreparedClaim],
                    claim_names: dict[str, str], cdi_dirs: list[Path]) -> dict[str, dict[str, Any]]:
    """container name -> what it gets, from its `resources.claims` and the prepared devices."""
    specs = load_specs(cdi_dirs)
    by_name = {p.ref.name: p for p in prepared.values()}
    out: dict[str, dict[str, Any]] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        ids: list[str] = []
        devices: list[str] = []
        for use in ((container.get("resources") or {}).get("claims")) or []:
            claim = by_name.get(claim_names.get(use.get("name", ""), ""))
            if claim is None:
                continue
            wanted = use.get("request")
            for dev in claim.devices:
                if wanted and dev.request_names and wanted not in dev.request_names:
                    continue
                devices.append(f"{dev.pool}/{dev.device}")
                ids += [i for i in dev.cdi_device_ids if i not in ids]
        if not ids:
            continue
        edits = resolve(ids, specs)
        out[container["name"]] = {"devices": devices, "cdiDevices": edits.cdi_devices, "env": edits.env,
                                  "deviceNodes": edits.device_nodes, "mounts": edits.mounts}
    return out


class PodRunner:
    """Runs this node's pods as far as DRA is concerned."""

    def __init__(self, node: str, api: client.ApiClient, dra: DraClient, cdi_dirs: list[Path],
                 resync_seconds: float = 30.0, on_change: Callable[[], None] | None = None):
        self.node = node
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.api = api
        self.dra = dra
        self.cdi_dirs = cdi_dirs
        self.resync_seconds = resync_seconds
        self.prepared: dict[str, PreparedClaim] = {}  # claim uid -> state
        self.pods: dict[str, dict[str, Any]] = {}  # pod uid -> last seen pod
        self._lock = asyncio.Lock()
        self._on_change = on_change
        self._retry: set[str] = set()

    # ------------------------------------------------------------------ API helpers
    async def _get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        obj = await self.custom.get_namespaced_custom_object("resource.k8s.io", "v1", namespace,
                                                             "resourceclaims", name)
        return dict(obj)

    async def _pod_status(self, pod: dict[str, Any], *, phase: str, ready: bool, reason: str = "",
                          message: str = "", edits: dict[str, Any] | None = None) -> None:
        meta = pod["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": "True" if ready else "False", "lastTransitionTime": now,
             **({"reason": reason, "message": message} if reason else {})},
            {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now,
             **({"reason": reason, "message": message} if reason else {})},
        ]
        statuses = [{
            "name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": ready, "restartCount": 0,
            "started": ready,
            "state": {"running": {"startedAt": now}} if ready else
                     {"waiting": {"reason": reason or "ContainerCreating", "message": message}},
        } for c in (pod.get("spec") or {}).get("containers") or []]
        status: dict[str, Any] = {"phase": phase, "conditions": conditions, "containerStatuses": statuses,
                                  "hostIP": "127.0.0.1", "podIP": "127.0.0.1"}
        if ready:
            status["startTime"] = now
        if edits is not None:
            body = {"metadata": {"annotations": {EDITS_ANNOTATION: json.dumps(edits, sort_keys=True)}}}
            await self.core.patch_namespaced_pod(meta["name"], meta["namespace"], body)
        await self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status})

    # ------------------------------------------------------------------ prepare / unprepare
    async def _prepare_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns, uid = meta["namespace"], meta["uid"]
        claim_names: dict[str, str] = {}
        wanted: dict[str, Claim] = {}
        drivers_of: dict[str, set[str]] = {}
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            name = claim_name_for(pod, entry)
            if name is None:
                raise PrepareFailed(f"claim {entry.get('name')!r} has not been generated yet")
            claim_names[entry["name"]] = name
            claim = await self._get_claim(ns, name)
            status = claim.get("status") or {}
            if not any(r.get("uid") == uid for r in status.get("reservedFor") or []):
                raise PrepareFailed(f"ResourceClaim {ns}/{name} is not reserved for this pod")
            results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
            ref = Claim(namespace=ns, uid=claim["metadata"]["uid"], name=name)
            wanted[ref.uid] = ref
            drivers_of[ref.uid] = {r["driver"] for r in results}
        for claim_uid, ref in wanted.items():
            if claim_uid in self.prepared:
                continue
            devices: list[PreparedDevice] = []
            for driver in sorted(drivers_of[claim_uid]):
                if driver not in self.dra.drivers():
                    raise PrepareFailed(f"driver {driver} is not registered on node {self.node}")
                answer = (await self.dra.prepare(driver, [ref])).get(claim_uid)
                if answer is None or answer.error:
                    raise PrepareFailed(f"{driver} could not prepare {ns}/{ref.name}: "
                                        f"{answer.error if answer else 'no answer'}")
                devices += answer.devices
            self.prepared[claim_uid] = PreparedClaim(ref, drivers_of[claim_uid], devices)
        for claim_uid in wanted:
            self.prepared[claim_uid].pods.add(uid)
        edits = container_edits(pod, {u: self.prepared[u] for u in wanted}, claim_names, self.cdi_dirs)
        await self._pod_status(pod, phase="Running", ready=True, edits=edits)
        log.info("pod running", node=self.node, pod=f"{ns}/{meta['name']}", claims=len(wanted))

    async def _release_pod(self, pod_uid: str) -> None:
        for claim_uid, state in list(self.prepared.items()):
            state.pods.discard(pod_uid)
            if state.pods:
                continue
            errors = [e for driver in sorted(state.drivers)
                      for e in [(await self.dra.unprepare(driver, [state.ref])).get(claim_uid, "")] if e]
            if errors:
                log.warning("unprepare failed; will retry", claim=state.ref.name, errors=errors)
                continue
            del self.prepared[claim_uid]
            log.info("claim unprepared", node=self.node, claim=f"{state.ref.namespace}/{state.ref.name}")

    async def sync_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        async with self._lock:
            self.pods[uid] = pod
            phase = (pod.get("status") or {}).get("phase", "Pending")
            if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
                await self._release_pod(uid)
                return
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (pod.get("status") or {}).get("conditions") or [])
            if phase == "Running" and ready and uid not in self._retry:
                # Known to be running; after a restart, re-learn which claims it holds.
                for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
                    name = claim_name_for(pod, entry)
                    for state in self.prepared.values():
                        if state.ref.name == name and state.ref.namespace == meta["namespace"]:
                            state.pods.add(uid)
                return
            try:
                await self._prepare_pod(pod)
                self._retry.discard(uid)
            except (PrepareFailed, CdiResolutionError, ApiException) as exc:
                self._retry.add(uid)
                reason = exc.reason if isinstance(exc, ApiException) else str(exc)
                log.info("pod not ready yet", node=self.node, pod=f"{meta['namespace']}/{meta['name']}",
                         reason=reason)
                with contextlib.suppress(ApiException):
                    await self._pod_status(pod, phase="Pending", ready=False, reason="PrepareResourcesFailed",
                                           message=str(reason))
        if self._on_change:
            self._on_change()

    async def forget_pod(self, uid: str) -> None:
        async with self._lock:
            self.pods.pop(uid, None)
            self._retry.discard(uid)
            await self._release_pod(uid)
        if self._on_change:
            self._on_change()

    async def retry_pending(self) -> None:
        """Try again the pods that could not start (claim not generated yet, driver not registered...)."""
        for uid in list(self._retry):
            pod = self.pods.get(uid)
            if pod is None:
                self._retry.discard(uid)
                continue
            meta = pod["metadata"]
            try:
                fresh = await self.core.read_namespaced_pod(meta["name"], meta["namespace"])
            except ApiException as exc:
                if exc.status == 404:
                    await self.forget_pod(uid)
                continue
            await self.sync_pod(self.api.sanitize_for_serialization(fresh))

    async def _retry_loop(self, stopping: asyncio.Event, wake: asyncio.Event | None) -> None:
        delay = 0.2
        while not stopping.is_set():
            waits = [asyncio.ensure_future(stopping.wait())]
            if wake is not None:
                waits.append(asyncio.ensure_future(wake.wait()))
            await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if wake is not None and wake.is_set():
                wake.clear()
                delay = 0.2
            if self._retry:
                await self.retry_pending()
                delay = min(delay * 2, 2.0) if self._retry else 0.2

    # ------------------------------------------------------------------ watch loop
    async def run(self, stopping: asyncio.Event, wake: asyncio.Event | None = None) -> None:
        """List+watch this node's pods until `stopping`; `wake` (plugins changed) retries waiting pods."""
        retry = asyncio.create_task(self._retry_loop(stopping, wake))
        try:
            await self._list_and_watch(stopping)
        finally:
            retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retry

    async def _list_and_watch(self, stopping: asyncio.Event) -> None:
        selector = f"spec.nodeName={self.node}"
        while not stopping.is_set():
            try:
                listed = await self.core.list_pod_for_all_namespaces(field_selector=selector)
                listing = self.api.sanitize_for_serialization(listed)
                seen = set()
                for pod in listing.get("items") or []:
                    seen.add(pod["metadata"]["uid"])
                    await self.sync_pod(pod)
                for uid in set(self.pods) - seen:
                    await self.forget_pod(uid)
                version = listing["metadata"].get("resourceVersion", "")
                await self._watch(selector, version, stopping)
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("pod watch failed; re-listing", node=self.node, status=exc.status)
            except (TimeoutError, OSError) as exc:
                log.warning("API server unreachable; retrying", node=self.node, error=str(exc))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 1.0)

    async def _watch(self, selector: str, version: str, stopping: asyncio.Event) -> None:
        w = watch.Watch()
        deadline = time.monotonic() + self.resync_seconds
        async with w:
            stream = w.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                              resource_version=version, timeout_seconds=max(1, int(self.resync_seconds)),
                              _preload_content=False, allow_watch_bookmarks=True)
            async for event in stream:
                if stopping.is_set():
                    return
                raw = event.get("raw_object") or {}
                kind = event.get("type")
                if kind == "ERROR":
                    raise ApiException(status=int(raw.get("code", 500)), reason=raw.get("message", ""))
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    await self.forget_pod(raw["metadata"]["uid"])
                else:
                    await self.sync_pod(raw)
                if time.monotonic() > deadline:
                    return
