"""How a GPU claim uses each of its devices: the sharing mode its configs give each one (time-slicing, MPS, a
share served by the GPU's MPS daemon, with the share's limits), whether another claim's hold on a device allows
this one too (the overlap guard's rule), and a share's device capacity as this node knows it. Pure functions
over the claim's plan; driver.py applies them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from services.preparer.host.checkpoint import PreparedDevice
from services.preparer.host.devices import ResolvedDevice
from services.preparer.nodesettings import NodeSettings
from shared.claimconfigs import (
    SHARE_MPS_CAPACITIES,
    ClaimConfigError,
    GpuConfig,
    MigDeviceConfig,
    Selected,
    ShareLimits,
    interval,
    pinned_limits,
    share_limits,
    strategy,
)
from shared.devicemodel import binary_si

_memory_si = functools.lru_cache(maxsize=256)(binary_si)  # a node's few device sizes, per share's prepare


@dataclass
class Planned:
    result_index: int
    request: str
    pool: str
    resolved: ResolvedDevice
    admin_access: bool
    share_id: str
    consumed: dict[str, str] = field(default_factory=dict)
    # a MIG device made on demand (dynamic MIG): not made yet, or made for claims that still hold it; made once
    # for its first holder and destroyed after its last (`GpuDriver.apply`, `GpuDriver.undo`)
    dynamic_mig: bool = False


@dataclass
class Mode:
    """How a claim uses one of its devices: for the guard, and for a share served by the GPU's MPS daemon."""

    sharing: str = ""  # "" | TimeSlicing | MPS
    shared: bool = False  # another claim may hold the device too (a sharing config, or a share)
    share_mps: bool = False  # a share (KEP-5075) served by the GPU's one MPS daemon
    daemon_settings: dict[str, int] = field(default_factory=dict)  # that daemon's start settings
    limits: ShareLimits = field(default_factory=ShareLimits)  # the share's client limits
    node_interval: str = ""  # a whole GPU time-sliced by its NodeConfig rule: that rule's interval
    interval: str = ""  # a full GPU time-sliced for this claim: the interval it gets (its config's, or its rule's)


def device_memory(r: ResolvedDevice) -> int:
    """A full GPU's or a MIG device's memory in bytes (0 when the inventory does not say)."""
    if r.kind == "mig":
        return r.mig.memory_mib << 20 if r.mig is not None else r.profile.memory_mib << 20 if r.profile else 0
    return r.gpu.memory_bytes if r.gpu is not None else 0


def share_modes(groups: list[Selected], planned: list[Planned]) -> dict[int, Mode]:
    """Each planned device's mode. A share is served through MPS when its config says MPS, or when it has
    no sharing config and consumes `compute` (an mpsShares GPU); the GPU's daemon is then started
    with the config's defaults for that GPU, and each share's limits go to its containers' env.
    ClaimConfigError for what cannot be served."""
    modes: dict[int, Mode] = {}
    for group in groups:
        kind = strategy(group.config)
        for i in group.results:
            p = planned[i]
            mode = Mode(sharing=kind, shared=bool(kind or p.share_id))
            if kind == "TimeSlicing" and p.resolved.kind == "gpu":
                mode.interval = interval(group.config)
            implied = not kind and any(c in p.consumed for c in SHARE_MPS_CAPACITIES)
            if p.share_id and (kind == "MPS" or implied):
                mode.sharing, mode.share_mps = "MPS", True
                gpu_memory = device_memory(p.resolved)
                mode.limits = share_limits(p.consumed, gpu_memory)
                if kind == "MPS":
                    assert isinstance(group.config, GpuConfig | MigDeviceConfig) and group.config.sharing is not None
                    mps = group.config.sharing.mpsConfig
                    limit = pinned_limits(mps, [p.resolved.uuid], {p.resolved.uuid: gpu_memory}).get(p.resolved.uuid)
                    if mps is not None and mps.defaultActiveThreadPercentage is not None:
                        mode.daemon_settings["activeThreadPercentage"] = mps.defaultActiveThreadPercentage
                    if limit is not None:
                        mode.daemon_settings["pinnedDeviceMemoryLimitMiB"] = limit >> 20
            modes[i] = mode
    gpus = {planned[i].resolved.uuid for i, m in modes.items() if m.share_mps}  # GPU or MIG device UUIDs
    if len(gpus) > 1:
        raise ClaimConfigError(
            f"the claim holds MPS shares of {len(gpus)} GPUs; a claim's containers reach one "
            "MPS daemon, so a claim may hold MPS shares of one GPU only"
        )
    _combine_share_limits([m for m in modes.values() if m.share_mps])
    return modes


def _combine_share_limits(modes: list[Mode]) -> None:
    """Several MPS shares of one device in one claim reach it as one CDI device, through one client env:
    their limits add up (memory unlimited if any share is; compute at most 100 percent)."""
    if len(modes) < 2:
        return
    memory = None if any(m.limits.memory is None for m in modes) else sum(m.limits.memory or 0 for m in modes)
    compute = (
        None if any(m.limits.compute is None for m in modes) else min(100, sum(m.limits.compute or 0 for m in modes))
    )
    for m in modes:
        m.limits = ShareLimits(memory=memory, compute=compute)


def conflict(mine: Mode, held: PreparedDevice) -> str:
    """Why this claim cannot have a device `held` by another claim as well; "" when it can."""
    if not mine.shared or not held.shared:
        if held.share_id and not mine.shared:
            return (
                "it has shares prepared for other claims, and this claim asks for it whole (no sharing "
                "config, no share); an exclusive claim waits until the shares are unprepared"
            )
        if mine.shared and not held.shared:
            return "another claim on this node holds it whole (no sharing config); it cannot be shared now"
        return ""  # the classic message (no one shares)
    if (mine.sharing == "MPS") != (held.sharing == "MPS"):
        return (
            f"it is in {held.sharing or 'default'} mode for other claims on this node, and this claim "
            f"asks for {mine.sharing or 'default'} sharing (time-slicing and MPS do not mix on one GPU)"
        )
    if mine.sharing != "MPS":
        if mine.interval and held.time_slice_interval and mine.interval != held.time_slice_interval:
            return (
                f"it is time-sliced at interval {held.time_slice_interval} for other claims on this node, and "
                f"this claim asks for {mine.interval}; a GPU has one interval: give every claim on it the same"
            )
        return ""
    if not (mine.share_mps and held.share_id):  # a held MPS share uses (or is about to use) the GPU's daemon
        return (
            "its MPS daemon serves another claim (a claim-scoped daemon); MPS shares of one GPU need "
            "allocations with a shareID"
        )
    if mine.daemon_settings != held.mps_daemon_settings:
        return (
            f"its MPS daemon runs for other shares with settings {held.mps_daemon_settings or 'none'}, and "
            f"this claim asks for {mine.daemon_settings or 'none'}; give every share of a GPU the same "
            "MPS config"
        )
    return ""


def group_pinned_limits(group: Selected, planned: list[Planned]) -> dict[str, int]:
    """An MPS group's pinned memory limits per GPU UUID, each at most that GPU's memory (ClaimConfigError if not)."""
    if strategy(group.config) != "MPS" or not isinstance(group.config, GpuConfig) or group.config.sharing is None:
        return {}
    gpus = [planned[i].resolved for i in group.results if planned[i].resolved.kind == "gpu"]
    memory = {r.uuid: r.gpu.memory_bytes for r in gpus if r.gpu is not None}
    return pinned_limits(group.config.sharing.mpsConfig, sorted({r.uuid for r in gpus}), memory)


def share_capacity(p: Planned, settings: NodeSettings) -> dict[str, str]:
    """A share's device's whole capacity under the names it consumes, as this node knows it (the claim
    events carry it, so a consumer can weigh the share): memory from the inventory, compute is 100 (percent),
    shares the GPU's NodeConfig `maxShares` (NVIDIA's <count> mode: a share of 1 is 1/N of the GPU)."""
    if not p.share_id:
        return {}
    out: dict[str, str] = {}
    r = p.resolved
    memory = device_memory(r)
    if "memory" in p.consumed and memory:
        out["memory"] = _memory_si(memory)
    if "compute" in p.consumed:
        out["compute"] = "100"
    if "shares" in p.consumed and r.gpu is not None:
        count = settings.setting(r.gpu).max_shares
        if count:
            out["shares"] = str(count)
    return out
