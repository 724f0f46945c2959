"""Inventory + health -> the pools a node should publish (pure: no I/O, no clock).

Owns the choices the publisher makes about a node: which devices each GPU advertises in the chosen
MIG mode (through `shared.devicemodel`), which taints an unhealthy device carries, the
`compute-domain.nvidia.com` devices, and the warnings a fallback deserves. `split.py` then cuts each
pool into slices the server accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from services.publisher import shares, split
from services.publisher.apiversion import ServerProfile
from shared import devicemodel, featuregates
from shared.events.health import DeviceHealth
from shared.events.inventory import Gpu, NodeInventory
from shared.kube.timestamps import k8s_time
from shared.nodeconfig import GpuSetting

GPU_DRIVER = devicemodel.GPU_DRIVER
CD_DRIVER = "compute-domain.nvidia.com"
TAINT_XID = "gpu.nvidia.com/xid"
TAINT_GPU_LOST = "gpu.nvidia.com/gpu-lost"
TAINT_UNMONITORED = "gpu.nvidia.com/unmonitored"
CLIQUE_ATTRIBUTE = "cliqueID"  # <clusterUUID>.<cliqueId>, as ComputeDomain status names cliques

MigMode = Literal["static", "dynamic"]
GpuMigMode = Literal["none", "static", "dynamic"]  # a GPU's own, from its NodeConfig rule
TaintEffect = Literal["NoSchedule", "NoExecute"]


class SliceOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Per-deployment choices."""

    mig_mode: MigMode = "static"
    taint_effect: TaintEffect = "NoSchedule"
    compute_domains: bool = True
    passthrough: bool = False  # every GPU offered for VFIO passthrough too (a NodeConfig rule may say per GPU)
    disabled_features: frozenset[str] = frozenset()  # the publisher's own gates that are off: off on every node


def disabled_features(inv: NodeInventory, opts: SliceOptions) -> frozenset[str]:
    """The gated features the node must not offer: off in the publisher, or off in the node's discovery."""
    return opts.disabled_features | {name for name, on in inv.features.items() if not on}


class DesiredPool(msgspec.Struct, kw_only=True):
    """One driver's pool on one node, already split into slice contents."""

    driver: str
    node: str
    slices: list[split.SliceContent]
    notes: list[str] = msgspec.field(default_factory=list)  # warnings for the log
    shares_withheld: int = 0  # GPUs whose shares the server's API version cannot express

    @property
    def device_count(self) -> int:
        return sum(len(s.devices) for s in self.slices)


def rfc3339(ts: float) -> str:
    """Seconds since the epoch -> `2026-12-03T06:00:00Z` (whole seconds, as the server stores it)."""
    return k8s_time(int(ts))


def health_taints(health: DeviceHealth | None, effect: TaintEffect, profile: ServerProfile) -> list[dict[str, Any]]:
    """The taints one health record calls for: XID value, GPU lost, or (1.35+) unmonitored."""
    if health is None or health.state == "Healthy":
        return []
    added = rfc3339(health.observed_at) if health.observed_at > 0 else None
    if health.state == "Unknown":
        if not profile.taint_effect_none:
            return []
        taint: dict[str, Any] = {"key": TAINT_UNMONITORED, "value": "", "effect": "None"}
    elif health.reason == "gpu-lost":
        taint = {"key": TAINT_GPU_LOST, "value": "", "effect": effect}
    else:
        taint = {"key": TAINT_XID, "value": str(health.xid), "effect": effect}
    if added:
        taint["timeAdded"] = added
    return [taint]


def _parent_name(device_name: str) -> str | None:
    parsed = devicemodel.parse_mig_name(device_name)
    return devicemodel.gpu_name(parsed[0]) if parsed else None


def device_taints(
    name: str, health: Mapping[str, DeviceHealth], effect: TaintEffect, profile: ServerProfile
) -> list[dict[str, Any]]:
    """A device's own taints, plus its parent GPU's for a MIG device (one taint per key, own first)."""
    taints = health_taints(health.get(name), effect, profile)
    parent = _parent_name(name)
    if parent is not None:
        keys = {t["key"] for t in taints}
        taints += [t for t in health_taints(health.get(parent), effect, profile) if t["key"] not in keys]
    return taints


def _gpu_devices(gpu: Gpu, inv: NodeInventory, mode: GpuMigMode, notes: list[str]) -> list[dict[str, Any]]:
    if mode == "dynamic":
        return devicemodel.dynamic_mode_devices(gpu, inv)
    if mode == "none" and gpu.mig_enabled:
        notes.append(
            f"{gpu.name} has MIG mode on and its NodeConfig rule says mig: none; it is not offered (turn MIG off "
            "on it, or give it mig: static or dynamic)"
        )
        return []
    devices = devicemodel.default_mode_devices(gpu, inv)
    if gpu.mig_enabled and not devices:  # as NVIDIA's driver: nothing allocatable, "likely stranded capacity"
        notes.append(
            f"{gpu.name} has MIG mode enabled but no configured MIG devices; its capacity is stranded "
            "(create MIG devices, or publish with --mig-mode dynamic to offer its placements)"
        )
    return devices


def _gpu_mode(pool_mode: MigMode, setting: GpuSetting | None) -> GpuMigMode:
    """A rule's `mig` for this GPU, else the pool's mode: none (the full GPU only, while MIG is off on it),
    static (the MIG devices that exist, else the full GPU) or dynamic (every placement, made on demand)."""
    if setting is None or setting.mig is None:
        return pool_mode
    return setting.mig


def _passthrough(
    gpu: Gpu, mode: GpuMigMode, setting: GpuSetting | None, opts: SliceOptions, notes: list[str], off: frozenset[str]
) -> bool:
    """Whether the GPU is offered for VFIO passthrough too: a rule's `passthrough`, else --passthrough; never
    a GPU with MIG on or in dynamic MIG mode (as NVIDIA's driver: a GPU without MIG devices only), nor with
    the PassthroughSupport gate off for the node."""
    wanted = setting.passthrough if setting is not None and setting.passthrough is not None else opts.passthrough
    if wanted and featuregates.PASSTHROUGH_SUPPORT in off:
        notes.append(
            f"{gpu.name}: passthrough asked for, but feature gate {featuregates.PASSTHROUGH_SUPPORT} is "
            "off for the node"
        )
        return False
    if wanted and (gpu.mig_enabled or mode == "dynamic"):
        notes.append(f"{gpu.name} is not offered for passthrough: MIG is on or dynamic")
        return False
    return wanted


def gpu_pool(
    inv: NodeInventory,
    health: Mapping[str, DeviceHealth],
    opts: SliceOptions,
    profile: ServerProfile,
    settings: Mapping[str, GpuSetting] | None = None,
) -> DesiredPool:
    """The node's `gpu.nvidia.com` pool: devices per the MIG mode, shares per each GPU's effective
    NodeConfig setting (`settings`, by GPU name; none: exclusive), taints from health, split to limits."""
    settings = settings or {}
    notes: list[str] = []
    mode = opts.mig_mode
    off = disabled_features(inv, opts)
    dynamic_allowed = featuregates.DYNAMIC_MIG not in off
    if not dynamic_allowed and (mode == "dynamic" or any(s.mig == "dynamic" for s in settings.values())):
        notes.append(
            f"dynamic MIG asked for, but feature gate {featuregates.DYNAMIC_MIG} is off for the node; "
            "publishing static devices"
        )
    if not dynamic_allowed:
        mode = "static"
    if mode == "dynamic" and inv.gpus and not any(devicemodel.supports_dynamic_mig(g) for g in inv.gpus):
        notes.append("dynamic MIG asked for, but no GPU on the node is MIG-capable; publishing static devices")
        mode = "static"
    devices: list[dict[str, Any]] = []
    counter_sets: list[dict[str, Any]] = []
    withheld = 0
    for gpu in inv.gpus:
        setting = settings.get(gpu.name)
        gpu_mode = _gpu_mode(mode, setting)
        if gpu_mode == "dynamic" and not dynamic_allowed:
            gpu_mode = "static"
        gpu_devices = _gpu_devices(gpu, inv, gpu_mode, notes)
        if gpu_mode == "dynamic" and devicemodel.supports_dynamic_mig(gpu):
            cs = devicemodel.counter_set(gpu)
            if cs is not None:
                counter_sets.append(cs)
        if _passthrough(gpu, gpu_mode, setting, opts, notes, off):
            counter_sets.append(devicemodel.passthrough_counter_set(gpu))
            gpu_devices = [devicemodel.with_passthrough(d, gpu) for d in gpu_devices]
            gpu_devices.append(devicemodel.vfio_device(gpu, inv))
        if setting is not None and setting.offers_shares:
            if featuregates.CONSUMABLE_SHARES in off:
                notes.append(
                    f"{gpu.name}: shares asked for, but feature gate {featuregates.CONSUMABLE_SHARES} is "
                    "off for the node; offering it whole"
                )
            elif profile.consumable_capacity:
                gpu_devices = [shares.offer_shares(d, setting) for d in gpu_devices]
            else:
                withheld += 1
        effect = setting.health_taint_effect if setting and setting.health_taint_effect else opts.taint_effect
        for device in gpu_devices:
            taints = device_taints(device["name"], health, effect, profile)
            if taints:
                device["taints"] = taints
        devices += gpu_devices
    return DesiredPool(
        driver=GPU_DRIVER,
        node=inv.node,
        notes=notes,
        shares_withheld=withheld,
        slices=split.split_pool(devices, counter_sets, profile),
    )


def clique_id(inv: NodeInventory) -> str:
    """`<clusterUUID>.<cliqueId>` when every GPU has completed fabric registration in one clique, else ""."""
    cliques = {
        (g.fabric.cluster_uuid, g.fabric.clique_id)
        for g in inv.gpus
        if g.fabric is not None and g.fabric.cluster_uuid and g.fabric.state == "completed"
    }
    if len(cliques) != 1 or any(g.fabric is None for g in inv.gpus):
        return ""
    cluster_uuid, clique = next(iter(cliques))
    return f"{cluster_uuid}.{clique}"


def compute_domain_pool(inv: NodeInventory, profile: ServerProfile) -> DesiredPool:
    """`channel-0` and `daemon-0`, with the node's NVLink clique when it has one."""
    clique = clique_id(inv)
    devices = []
    for kind in ("channel", "daemon"):
        attrs: dict[str, Any] = {"type": {"string": kind}, "id": {"int": 0}}
        if clique:
            attrs[CLIQUE_ATTRIBUTE] = {"string": clique}
        devices.append({"name": f"{kind}-0", "attributes": attrs})
    return DesiredPool(driver=CD_DRIVER, node=inv.node, slices=split.split_pool(devices, [], profile))


def desired_pools(
    inv: NodeInventory,
    health: Mapping[str, DeviceHealth],
    opts: SliceOptions,
    profile: ServerProfile,
    settings: Mapping[str, GpuSetting] | None = None,
) -> dict[str, DesiredPool]:
    """Every pool the node should have, by driver. A driver missing from the result has no pool.
    `settings`: each GPU's effective NodeConfig setting by name (`shared.nodeconfig.resolve`)."""
    pools = {GPU_DRIVER: gpu_pool(inv, health, opts, profile, settings)}
    if opts.compute_domains and inv.gpus:
        pools[CD_DRIVER] = compute_domain_pool(inv, profile)
    return pools


DRIVERS = (GPU_DRIVER, CD_DRIVER)
