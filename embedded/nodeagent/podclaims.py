"""What a pod asks of the DRA drivers and what it gets: its claims and their uses by its containers, the
CDI edits each container gets from the prepared claims, and the pod status the kubelet writes (pure
functions over plain pod dicts), with the DRA client protocol the pod loop (`pods.py`) calls."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from embedded.kubelet.client import Claim, PreparedDevice
from embedded.kubelet.client import PreparedClaim as KubeletPreparedClaim
from embedded.nodeagent.cdi_resolve import SpecCache, load_specs, resolve
from embedded.nodeagent.containers import now as timestamp
from embedded.nodeagent.resourcehealth import DeviceHealthCache, allocated_resources_status

EDITS_ANNOTATION = "gpu.nvidia.com/container-edits"
WAITING_REASON = "ContainerCreating"


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


# (claim name, request name or "" for the whole claim)
Use = tuple[str, str]


def claim_name_for(pod: dict[str, Any], entry: dict[str, Any]) -> str | None:
    """The ResourceClaim a pod's `spec.resourceClaims[]` entry refers to (None until generated)."""
    if entry.get("resourceClaimName"):
        return str(entry["resourceClaimName"])
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if status.get("name") == entry.get("name") and status.get("resourceClaimName"):
            return str(status["resourceClaimName"])
    return None


def pod_claims(pod: dict[str, Any]) -> tuple[list[str], dict[str, list[Use]]]:
    """(claim names the pod needs, container name -> what of them it uses). Raises if one is not generated."""
    spec = pod.get("spec") or {}
    by_entry: dict[str, str] = {}
    for entry in spec.get("resourceClaims") or []:
        name = claim_name_for(pod, entry)
        if name is None:
            raise PrepareFailed(f"claim {entry.get('name')!r} has not been generated yet")
        by_entry[entry["name"]] = name
    names = list(dict.fromkeys(by_entry.values()))
    uses: dict[str, list[Use]] = {}
    for container in spec.get("containers") or []:
        for ref in ((container.get("resources") or {}).get("claims")) or []:
            name = by_entry.get(ref.get("name", ""))
            if name:
                uses.setdefault(container["name"], []).append((name, ref.get("request") or ""))
    extended = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
    if extended.get("resourceClaimName"):
        name = str(extended["resourceClaimName"])
        if name not in names:
            names.append(name)
        for mapping in extended.get("requestMappings") or []:
            uses.setdefault(mapping.get("containerName", ""), []).append((name, mapping.get("requestName") or ""))
    return names, uses


def _wants(request: str, names: list[str]) -> bool:
    return not request or not names or any(n == request or n.split("/")[0] == request for n in names)


def container_edits(
    pod: dict[str, Any],
    prepared: dict[str, PreparedClaim],
    uses: dict[str, list[Use]],
    cdi_dirs: list[Path],
    cache: SpecCache | None = None,
) -> dict[str, dict[str, Any]]:
    """container name -> what it gets, from the claims (and requests) it uses and the prepared devices."""
    specs = load_specs(cdi_dirs, cache)
    by_name = {p.ref.name: p for p in prepared.values()}
    out: dict[str, dict[str, Any]] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        ids: list[str] = []
        devices: list[str] = []
        for claim_name, request_name in uses.get(container["name"], []):
            claim = by_name.get(claim_name)
            if claim is None:
                continue
            for dev in claim.devices:
                if not _wants(request_name, dev.request_names):
                    continue
                label = f"{dev.pool}/{dev.device}"
                if label not in devices:
                    devices.append(label)
                ids += [i for i in dev.cdi_device_ids if i not in ids]
        if not ids:
            continue
        edits = resolve(ids, specs)
        out[container["name"]] = {
            "devices": devices,
            "cdiDevices": edits.cdi_devices,
            "env": edits.env,
            "deviceNodes": edits.device_nodes,
            "mounts": edits.mounts,
        }
    return out


def status_inputs(pod: dict[str, Any]) -> str:
    """What a prepare attempt depends on in the pod itself (not our own status writes)."""
    status = pod.get("status") or {}
    annotations = {
        k: v for k, v in ((pod.get("metadata") or {}).get("annotations") or {}).items() if k != EDITS_ANNOTATION
    }
    return json.dumps(
        [
            (pod.get("spec") or {}).get("resourceClaims"),
            status.get("resourceClaimStatuses"),
            status.get("extendedResourceClaimStatus"),
            annotations,
        ],
        sort_keys=True,
    )


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def pod_status(pod: dict[str, Any], *, phase: str, exit_code: int | None = None) -> dict[str, Any]:
    """A pod status as the kubelet writes it: Running/Ready, Pending with containers `ContainerCreating`, or
    terminated. Written as a strategic merge patch, so what another state set is nulled (no stale reason)."""
    now = timestamp()
    ready = phase == "Running"
    names = " ".join(c["name"] for c in (pod.get("spec") or {}).get("containers") or [])
    why: dict[str, Any] = {"reason": None, "message": None}
    if exit_code is not None:
        why = {"reason": "PodCompleted", "message": None}
    elif not ready:
        why = {"reason": "ContainersNotReady", "message": f"containers with unready status: [{names}]"}
    conditions = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": "True" if ready else "False", "lastTransitionTime": now, **why},
        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now, **why},
    ]
    started = ((pod.get("status") or {}).get("startTime")) or now
    statuses = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        if exit_code is not None:
            state: dict[str, Any] = {
                "waiting": None,
                "running": None,
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "startedAt": started,
                    "finishedAt": now,
                },
            }
        elif ready:
            state = {"waiting": None, "terminated": None, "running": {"startedAt": now}}
        else:
            state = {"running": None, "terminated": None, "waiting": {"reason": WAITING_REASON}}
        statuses.append(
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": ready,
                "restartCount": 0,
                "started": ready,
                "state": state,
            }
        )
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "containerStatuses": statuses,
        "hostIP": "127.0.0.1",
    }
    if phase != "Pending":
        status["podIP"] = "127.0.0.1"
        status["startTime"] = started
    return status


def fill_resource_health(
    pod: dict[str, Any], statuses: list[dict[str, Any]], prepared: Iterable[PreparedClaim], health: DeviceHealthCache
) -> bool:
    """Set each container status's `allocatedResourcesStatus` (KEP-4680) from the devices prepared for the
    pod's claims and their health; True when any container has one."""
    namespace = pod["metadata"]["namespace"]
    names = {
        e["name"]: n
        for e in (pod.get("spec") or {}).get("resourceClaims") or []
        if (n := claim_name_for(pod, e)) is not None
    }
    claims = list(prepared)

    def devices_of(claim: str) -> list[tuple[str, PreparedDevice]]:
        state = next((c for c in claims if c.ref.namespace == namespace and c.ref.name == claim), None)
        if state is None:
            return []
        drivers = sorted(state.drivers)
        return (
            [
                (next((d for d in drivers if (d, dev.pool, dev.device) in health.devices), drivers[0]), dev)
                for dev in state.devices
            ]
            if drivers
            else []
        )

    by_container = allocated_resources_status(pod, names, devices_of, health)
    for status in statuses:
        if status.get("name") in by_container:
            status["allocatedResourcesStatus"] = by_container[status["name"]]
    return bool(by_container)
