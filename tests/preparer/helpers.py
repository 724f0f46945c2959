"""Test helpers for the preparer: short socket roots, ResourceClaim documents, a preparer on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import uuid as uuidlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from embedded.kubelet.client import Claim, DraPlugin, register
from services.preparer.config import PreparerConfig
from services.preparer.host.claims import ClaimNotFound, ResourceClaim
from services.preparer.host.service import PreparerService
from shared.events import devicemetadata

DRIVER = "gpu.nvidia.com"
GROUP = "resource.nvidia.com/v1beta1"


def short_root() -> Path:
    """A short directory for unix sockets (sun_path is 108 bytes; pytest's tmp_path can be longer)."""
    return Path(tempfile.mkdtemp(prefix="gdp-", dir="/tmp"))  # noqa: S108


def claim_doc(
    *,
    name: str,
    results: list[tuple[str, str]],
    node: str = "n1",
    namespace: str = "default",
    uid: str | None = None,
    configs: list[dict[str, Any]] | None = None,
    driver: str = DRIVER,
    pool: str | None = None,
    admin: bool = False,
) -> dict[str, Any]:
    """A ResourceClaim (resource.k8s.io/v1) allocated with `results` = [(request, device)]."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuidlib.uuid4())},
        "spec": {
            "devices": {
                "requests": [
                    {"name": r.split("/")[0], "exactly": {"deviceClassName": "gpu.nvidia.com"}}
                    for r in dict.fromkeys(r for r, _ in results)
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": r,
                            "driver": driver,
                            "pool": pool or node,
                            "device": d,
                            **({"adminAccess": True} if admin else {}),
                        }
                        for r, d in results
                    ],
                    "config": configs or [],
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            }
        },
    }


def without_metadata(edits: dict[str, Any]) -> dict[str, Any]:
    """A CDI device's container edits less the device metadata file's mount and env (tests/preparer/
    test_device_metadata.py checks those), for tests about the other edits."""
    return {
        **edits,
        "env": [e for e in edits.get("env") or [] if not e.startswith(f"{devicemetadata.ENV}=")],
        "mounts": [
            m for m in edits.get("mounts") or [] if not m["containerPath"].startswith(devicemetadata.CONTAINER_ROOT)
        ],
    }


def gpu_config(
    sharing: dict[str, Any] | None = None,
    *,
    requests: list[str] | None = None,
    kind: str = "GpuConfig",
    source: str = "FromClaim",
    **extra: Any,
) -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": GROUP, "kind": kind, **extra}
    if sharing is not None:
        params["sharing"] = sharing
    return {"source": source, "requests": requests or [], "opaque": {"driver": DRIVER, "parameters": params}}


class MemoryClaims:
    """A ClaimSource over documents held in memory (unit level; end-to-end tests use the API server)."""

    def __init__(self) -> None:
        self.docs: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, doc: dict[str, Any]) -> Claim:
        meta = doc["metadata"]
        self.docs[(meta["namespace"], meta["name"])] = doc
        return Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])

    def delete(self, namespace: str, name: str) -> None:
        self.docs.pop((namespace, name), None)

    async def get(self, namespace: str, name: str) -> ResourceClaim:
        doc = self.docs.get((namespace, name))
        if doc is None:
            raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found")
        return msgspec.convert(doc, ResourceClaim)


def checkpoint(root: Path) -> dict[str, Any]:
    """The claims the preparer of `root` (node_config's layout) has prepared: its checkpoint's records by UID."""
    prepared: dict[str, Any] = json.loads((root / "plugins" / "gpu.nvidia.com" / "checkpoint.json").read_text())[
        "preparedClaims"
    ]
    return prepared


def spec_of(cdi_dir: Path, uid: str) -> dict[str, Any]:
    """The CDI spec a prepared claim's checkpoint record names: its own, or one its shares use with other claims."""
    spec: dict[str, Any] = json.loads((cdi_dir / checkpoint(cdi_dir.parent)[uid]["cdi_spec"]).read_text())
    return spec


@dataclass
class Node:
    """A preparer on real unix sockets, and the kubelet emulator registered with it."""

    root: Path
    cfg: PreparerConfig
    service: PreparerService
    plugin: DraPlugin

    @property
    def cdi_dir(self) -> Path:
        return Path(self.cfg.cdi_dir)

    def cdi_files(self) -> list[str]:
        return sorted(p.name for p in self.cdi_dir.glob("*.json")) if self.cdi_dir.exists() else []


def node_config(root: Path, node: str = "n1", **overrides: Any) -> PreparerConfig:
    boot = root / "boot_id"
    if not boot.exists():
        boot.write_text(str(uuidlib.uuid4()) + "\n")
    return PreparerConfig(
        **{
            "node": node,
            "registry_dir": str(root / "reg"),
            "plugins_dir": str(root / "plugins"),
            "cdi_dir": str(root / "cdi"),
            "boot_id_path": str(boot),
            **overrides,
        }
    )


@contextlib.asynccontextmanager
async def running_node(
    claims: Any,
    root: Path,
    *,
    bus: Any = None,
    node: str = "n1",
    driver: str = DRIVER,
    settings: Any = None,
    **overrides: Any,
) -> AsyncIterator[Node]:
    """The preparer of `driver` on its real sockets, registered with a kubelet emulator."""
    cfg = node_config(root, node, **overrides)
    service = PreparerService(cfg, claims, driver=driver, settings=settings)
    await service.start()
    if bus is not None:
        service.attach_bus(bus)
        await wait_inventory(service)
    plugin = await register(service.registration_socket)
    try:
        yield Node(root, cfg, service, plugin)
    finally:
        await plugin.close()
        await service.stop()


async def wait_inventory(service: PreparerService, timeout: float = 10.0) -> None:
    """Until the preparer has discovery's inventory for its node."""
    async with asyncio.timeout(timeout):
        plugin: Any = (
            service.plugin
        )  # both drivers' plugins keep an Inventory; the DriverPlugin protocol does not name it
        while plugin.inventory.current is None:
            await plugin.inventory.changed.wait()


def cleanup(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


class ApiClaims:
    """Claims in the embedded API server: created, then allocated through the status subresource."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes_asyncio.client import ResourceV1Api

        self.client = api_client
        self.api = ResourceV1Api(api_client)

    async def add(self, doc: dict[str, Any]) -> Claim:
        body = {k: v for k, v in doc.items() if k != "status"}
        body["metadata"] = {k: v for k, v in doc["metadata"].items() if k != "uid"}
        ns = body["metadata"]["namespace"]
        created = await self.api.create_namespaced_resource_claim(ns, body)  # type: ignore[arg-type]  # sent as it is
        current = self.client.sanitize_for_serialization(created)
        current["status"] = doc.get("status", {})
        await self.api.replace_namespaced_resource_claim_status(created.metadata.name, ns, current)
        return Claim(namespace=ns, uid=created.metadata.uid, name=created.metadata.name)

    async def delete(self, claim: Claim) -> None:
        await self.api.delete_namespaced_resource_claim(claim.name, claim.namespace)


async def send_all(events: Any, bus: Any) -> None:
    """Attach `bus` to a LifecycleEvents and run its sender until everything pending is sent."""
    events.attach(bus)
    sender = asyncio.create_task(events.run())
    try:
        await events.drained()
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
