"""Device metadata files of prepared claims (KEP-5304): written per claim request, mounted read-only by the CDI spec.

Owns, as `<plugin dir>/device-metadata/<claim uid>_<request>.json` (one directory: a write's fsync of it makes
the file's name durable), the file of each request of a claim (format and container path:
`shared.events.devicemetadata`), the facts it carries per device (type, UUID, MIG parent, PCI bus id, IOMMU group, NUMA
node, share id), and the CDI edits that hand it to the containers: a read-only bind mount at the well-known path, and
`GPU_DRA_DEVICE_METADATA_FILE` naming it. Crash argument, as the CDI spec's (`cdi` module doc): each file is written
whole (temp file, rename) before the claim's spec that mounts it, removed after that spec on undo, and at start the
files of claims the checkpoint does not hold are swept; without a boot id every write is fsync'd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.preparer.gpu.pcisysfs import PciError, normal_bdf
from services.preparer.host.cdi import CdiDevice, Mount
from services.preparer.host.checkpoint import PreparedDevice, atomic_write
from services.preparer.host.claims import ResourceClaim
from shared.devicemodel import PCI_BUS_ID
from shared.events import devicemetadata as dm
from shared.events.inventory import Gpu

SUBDIR = "device-metadata"
READ_ONLY_FILE = ["ro", "nosuid", "nodev", "bind"]


class MetadataError(OSError):
    """A metadata file could not be written."""


@dataclass(frozen=True)
class MetadataSource:
    """One prepared device of a claim and what its file says about it."""

    request: str  # as allocated: `req` or `req/sub`
    device: PreparedDevice
    gpu: Gpu | None  # the physical GPU (a MIG device's parent), from the inventory


def _bus_id(text: str) -> str:
    try:
        return normal_bdf(text)
    except PciError:
        return text


def attributes(src: MetadataSource) -> dict[str, dm.DeviceAttributeValue]:
    """The facts the file carries about one device, by attribute name (the slices' names where they exist)."""
    dev, gpu = src.device, src.gpu
    out = {"type": dm.DeviceAttributeValue(string=dev.kind)}
    if dev.uuid:
        out["uuid"] = dm.DeviceAttributeValue(string=dev.uuid)
    if dev.parent_uuid:
        out["parentUUID"] = dm.DeviceAttributeValue(string=dev.parent_uuid)
    bus_id = dev.pci_bus_id or (gpu.pci_bus_id if gpu is not None else "")
    if bus_id:
        out[PCI_BUS_ID] = dm.DeviceAttributeValue(string=_bus_id(bus_id))
    if dev.iommu_group >= 0:
        out["iommuGroup"] = dm.DeviceAttributeValue(int_=dev.iommu_group)
    if gpu is not None and gpu.numa_node >= 0:
        out["numaNode"] = dm.DeviceAttributeValue(int_=gpu.numa_node)
    if gpu is not None and gpu.product_name:
        out["productName"] = dm.DeviceAttributeValue(string=gpu.product_name)
    if dev.share_id:
        out["shareID"] = dm.DeviceAttributeValue(string=dev.share_id)
    return out


class MetadataFiles:
    """One driver's metadata files under `root` (`<plugin dir>/device-metadata`)."""

    def __init__(self, root: Path, driver: str, *, durable: bool = True) -> None:
        self.root = str(root)
        self.driver = driver
        self.durable = durable  # False where a power loss is a reboot that drops every prepared claim

    def host_path(self, claim_uid: str, request: str) -> str:
        return os.path.join(self.root, f"{claim_uid}_{request.split('/', 1)[0]}.json")

    def documents(self, claim: ResourceClaim, sources: Sequence[MetadataSource]) -> dict[str, dm.DeviceMetadata]:
        """The claim's files by top-level request name, each listing that request's devices."""
        meta = claim.metadata
        requests: dict[str, dm.MetadataRequest] = {}
        for src in sources:
            base = src.request.split("/", 1)[0]
            entry = requests.setdefault(base, dm.MetadataRequest(name=src.request))
            entry.devices.append(
                dm.MetadataDevice(
                    driver=self.driver, pool=src.device.pool, name=src.device.device, attributes=attributes(src)
                )
            )
        pod_claim = meta.annotations.get(dm.POD_CLAIM_ANNOTATION, "")
        return {
            base: dm.document(
                name=meta.name, namespace=meta.namespace, uid=meta.uid, pod_claim_name=pod_claim, request=request
            )
            for base, request in requests.items()
        }

    async def add_to(
        self, claim: ResourceClaim, sources: Sequence[MetadataSource], cdi_devices: Sequence[CdiDevice]
    ) -> None:
        """Write the claim's files and add their mounts and env to `cdi_devices` (one per source, in order).
        A device name in several requests (shares of one GPU) carries every such request's file."""
        docs = self.documents(claim, sources)
        meta = claim.metadata
        pod_claim = meta.annotations.get(dm.POD_CLAIM_ANNOTATION, "")
        files = {
            base: (
                self.host_path(meta.uid, base),
                dm.container_path(self.driver, base, claim_name=meta.name, pod_claim_name=pod_claim),
            )
            for base in docs
        }
        await self._write(meta.uid, {files[base][0]: dm.encode(doc) for base, doc in docs.items()})
        by_name: dict[str, list[str]] = {}
        for src in sources:
            base = src.request.split("/", 1)[0]
            names = by_name.setdefault(src.device.device, [])
            if base not in names:
                names.append(base)
        for src, cdi in zip(sources, cdi_devices, strict=True):
            bases = by_name[src.device.device]
            cdi.mounts += [Mount(files[b][0], files[b][1], list(READ_ONLY_FILE)) for b in bases]
            cdi.env.append(f"{dm.ENV}={files[bases[0]][1]}")

    async def _write(self, claim_uid: str, contents: dict[str, bytes]) -> None:
        try:
            if self.durable:
                await asyncio.to_thread(self._write_sync, contents)
            else:  # a few hundred bytes into the page cache: cheaper than the hop to a thread (as the CDI spec)
                self._write_sync(contents)
        except OSError as exc:
            raise MetadataError(f"cannot write device metadata of claim {claim_uid}: {exc}") from exc

    def _write_sync(self, contents: dict[str, bytes]) -> None:
        for path, data in contents.items():
            try:
                atomic_write(path, data, sync_dir=self.durable, sync_file=self.durable)
            except FileNotFoundError:  # no directory yet (or removed): made here, not checked on every write
                os.makedirs(self.root, exist_ok=True)
                atomic_write(path, data, sync_dir=self.durable, sync_file=self.durable)

    async def remove(self, claim_uid: str, requests: Sequence[str]) -> None:
        """Delete the claim's files of `requests` (top-level names); absent ones are fine. An unlink each, on the
        event loop, as the CDI spec's."""
        for request in dict.fromkeys(requests):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.host_path(claim_uid, request))

    async def sweep(self, keep: set[str]) -> list[str]:
        """At start: remove the files of claims not in `keep` (the checkpoint's); the file names removed."""
        return await asyncio.to_thread(self._sweep_sync, keep)

    def _sweep_sync(self, keep: set[str]) -> list[str]:
        """Files are `<uid>_<request>.json`, and `.<file>.<pid>.tmp` where a crash cut a write short."""
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return []
        removed = []
        for name in entries:
            if name.startswith(".") or name.split("_", 1)[0] not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.root, name))
                removed.append(name)
        return removed
