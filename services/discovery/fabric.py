"""Fabric Manager's NVLink partitions (shared NVSwitch mode): list, activate, deactivate.

Owns talking to Fabric Manager through NVIDIA's partition tool `fmpm` (NVIDIA/Fabric-Manager-Client):
`fmpm -l` prints the supported partitions as JSON (`partitionInfo[]`: `partitionId`, `isActive`,
`gpuInfo[]` with `physicalId`, `uuid`, `pciBusId`, NVLink counts), `-a <id>` activates one, `-d <id>`
deactivates one; `--unix-domain-socket PATH` or `--hostname HOST` say where Fabric Manager listens
(its FM_CMD_UNIX_SOCKET_PATH or FM_CMD_BIND_INTERFACE). The tool runs from the driver root like
nvidia-smi, as an asyncio subprocess with a timeout. Also owns turning Fabric Manager's partitions into
the inventory's `FabricManagerState`: each partition GPU matched to this node's `gpu-<minor>` by PCI
bus id (else by module id), and the checks NVIDIA's driver makes (unique ids, no empty partition, no
GPU twice in one). The simulated Fabric Manager (`simfabric`) answers the same three calls in-process.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Protocol

import msgspec

from services.discovery.topology import normalise_bus_id
from shared.drivertools import DriverTools, ToolError
from shared.events.inventory import FabricManagerState, FabricPartition, FabricPartitionGpu

TOOL = "fmpm"


class FabricError(RuntimeError):
    """Fabric Manager refused or could not be asked; `code` is the DeviceOpError code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class FmGpu(msgspec.Struct, kw_only=True):
    """One GPU of `fmpm -l`'s `gpuInfo` (fmFabricPartitionGpuInfo_t)."""

    physical_id: int = msgspec.field(name="physicalId")
    uuid: str = ""
    pci_bus_id: str = msgspec.field(name="pciBusId", default="")
    nvlinks_available: int = msgspec.field(name="numNvLinksAvailable", default=0)
    max_nvlinks: int = msgspec.field(name="maxNumNvLinks", default=0)
    line_rate_mbps: int = msgspec.field(name="nvlinkLineRateMBps", default=0)


class FmPartition(msgspec.Struct, kw_only=True):
    """One entry of `fmpm -l`'s `partitionInfo` (fmFabricPartitionInfo_t); `isActive` is 0 or 1."""

    partition_id: int = msgspec.field(name="partitionId")
    is_active: int = msgspec.field(name="isActive", default=0)
    gpu_info: list[FmGpu] = msgspec.field(name="gpuInfo", default_factory=list)


class FmPartitionList(msgspec.Struct, kw_only=True):
    """`fmpm -l`'s output (fmFabricPartitionList_t)."""

    partition_info: list[FmPartition] = msgspec.field(name="partitionInfo", default_factory=list)


class FabricManagerClient(Protocol):
    """The three Fabric Manager calls discovery makes."""

    async def partitions(self) -> list[FmPartition]: ...

    async def activate(self, partition_id: int) -> None: ...

    async def deactivate(self, partition_id: int) -> None: ...


class Fmpm:
    """Fabric Manager through the `fmpm` tool under the driver root."""

    def __init__(self, tools: DriverTools, *, tool: str = TOOL, socket: str = "", address: str = ""):
        self.tools = tools
        self.tool = tool
        if address:
            self.connect = ["--hostname", address]
        elif socket:  # a host path: the tool runs here, where the driver root is mounted
            self.connect = ["--unix-domain-socket", str(tools.root.local(socket))]
        else:
            self.connect = []

    async def _run(self, *args: str) -> str:
        try:
            result = await self.tools.run(self.tool, [*args, *self.connect])
        except ToolError as exc:
            raise FabricError("fabric-manager-unavailable", str(exc)) from exc
        if result.returncode != 0:
            detail = (result.stdout + result.stderr).strip() or "no output"
            raise FabricError(
                "fabric-manager-error", f"{self.tool} {' '.join(args)} failed (exit {result.returncode}): {detail}"
            )
        return result.stdout

    async def partitions(self) -> list[FmPartition]:
        out = await self._run("-l")
        try:
            return msgspec.json.decode(out.encode(), type=FmPartitionList).partition_info
        except (msgspec.DecodeError, json.JSONDecodeError) as exc:
            raise FabricError("fabric-manager-error", f"{self.tool} -l printed no partition list: {exc}") from exc

    async def activate(self, partition_id: int) -> None:
        await self._run("-a", str(partition_id))

    async def deactivate(self, partition_id: int) -> None:
        await self._run("-d", str(partition_id))


NodeGpu = tuple[str, str, int]
"""(device name gpu-<minor>, normalised PCI bus id, module id): what a partition GPU is matched against."""


def check(partitions: list[FmPartition]) -> None:
    """FabricError for partitions NVIDIA's driver refuses too: a duplicate id, an empty partition, a GPU twice."""
    seen: set[int] = set()
    for p in partitions:
        if p.partition_id in seen:
            raise FabricError("fabric-manager-error", f"Fabric Manager lists partition {p.partition_id} twice")
        seen.add(p.partition_id)
        if not p.gpu_info:
            raise FabricError("fabric-manager-error", f"Fabric Manager's partition {p.partition_id} has no GPUs")
        modules = [g.physical_id for g in p.gpu_info]
        if len(set(modules)) != len(modules):
            raise FabricError(
                "fabric-manager-error",
                f"Fabric Manager's partition {p.partition_id} names a GPU module twice: {modules}",
            )


def _bus_id(text: str) -> str:
    try:
        return normalise_bus_id(text) if text else ""
    except ValueError:
        return text.strip().lower()


def to_state(partitions: list[FmPartition], gpus: Iterable[NodeGpu]) -> FabricManagerState:
    """Fabric Manager's partitions with each GPU matched to this node's device (module doc)."""
    check(partitions)
    by_bus = {bus: name for name, bus, _ in gpus if bus}
    by_module = {module: name for name, _, module in gpus if module}
    out = []
    for p in sorted(partitions, key=lambda p: p.partition_id):
        members = []
        for g in p.gpu_info:
            bus = _bus_id(g.pci_bus_id)
            members.append(
                FabricPartitionGpu(
                    module_id=g.physical_id,
                    pci_bus_id=bus,
                    uuid=g.uuid,
                    device=by_bus.get(bus) or by_module.get(g.physical_id, ""),
                    nvlinks_available=g.nvlinks_available,
                    max_nvlinks=g.max_nvlinks,
                    nvlink_line_rate_mbps=g.line_rate_mbps,
                )
            )
        out.append(FabricPartition(id=p.partition_id, active=bool(p.is_active), gpus=members))
    return FabricManagerState(partitions=out)


class FabricPartitions:
    """Fabric Manager's partitions as this node's inventory holds them, and the calls that change them."""

    def __init__(self, client: FabricManagerClient):
        self.client = client

    async def read(self, gpus: Iterable[NodeGpu]) -> FabricManagerState:
        """The partitions now; FabricError when Fabric Manager cannot be asked or answers nonsense."""
        return to_state(await self.client.partitions(), gpus)

    async def scan(self, gpus: Iterable[NodeGpu]) -> FabricManagerState:
        """`read` for an inventory scan: a failure is reported in the state, never raised."""
        try:
            return await self.read(gpus)
        except FabricError as exc:
            return FabricManagerState(error=str(exc))
