"""Cutting one pool's devices and counter sets into slices the API server accepts (pure).

Owns the per-slice limits' consequences: at most 128 devices (64 on 1.35+ once a device in the
slice has taints or consumes counters), counter sets beside their consumers (1.34) or in
counters-only slices of at most 8 sets (1.35+), and at most 32 counters per set. A pool always
has at least one slice, possibly empty, so consumers can tell "no devices" from "not published".
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.publisher.apiversion import ServerProfile


class SplitError(ValueError):
    """The pool cannot be laid out within the server's limits (the message says which limit)."""


class SliceContent(msgspec.Struct, kw_only=True):
    """What one ResourceSlice carries besides its pool and node."""

    devices: list[dict[str, Any]] = msgspec.field(default_factory=list)
    shared_counters: list[dict[str, Any]] = msgspec.field(default_factory=list)


def _restricted(device: dict[str, Any]) -> bool:
    return bool(device.get("taints") or device.get("consumesCounters"))


def pack(devices: list[dict[str, Any]], profile: ServerProfile) -> list[list[dict[str, Any]]]:
    """Devices, in order, into as few chunks as the device limits allow."""
    chunks: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    restricted = False
    for device in devices:
        would_restrict = restricted or _restricted(device)
        if current and len(current) + 1 > profile.max_devices(would_restrict):
            chunks.append(current)
            current, would_restrict = [], _restricted(device)
        current.append(device)
        restricted = would_restrict
    if current:
        chunks.append(current)
    return chunks


def _counter_count(counter_set: dict[str, Any]) -> int:
    return len(counter_set.get("counters") or {})


def _consumed_set(device: dict[str, Any]) -> str | None:
    consumes = device.get("consumesCounters") or []
    return str(consumes[0]["counterSet"]) if consumes else None


def split_pool(
    devices: list[dict[str, Any]], counter_sets: list[dict[str, Any]], profile: ServerProfile
) -> list[SliceContent]:
    """The slices of one pool. Devices keep their order; each counter set keeps its consumers together."""
    for cs in counter_sets:
        if _counter_count(cs) > profile.max_counters_per_slice:
            raise SplitError(
                f"counter set {cs['name']} has {_counter_count(cs)} counters; the server allows "
                f"{profile.max_counters_per_slice} per slice"
            )
    known = {cs["name"] for cs in counter_sets}
    consumers: dict[str, list[dict[str, Any]]] = {name: [] for name in known}
    plain: list[dict[str, Any]] = []
    for device in devices:
        set_name = _consumed_set(device)
        if set_name is None:
            plain.append(device)
        elif set_name in known:
            consumers[set_name].append(device)
        else:
            raise SplitError(f"device {device['name']} consumes counter set {set_name}, which the pool lacks")
    out: list[SliceContent] = []
    if profile.counter_layout == "beside-devices":
        for cs in counter_sets:
            chunks = pack(consumers[cs["name"]], profile) or [[]]
            if len(chunks) > 1:
                raise SplitError(
                    f"counter set {cs['name']} has {len(consumers[cs['name']])} consuming devices; on this "
                    f"server they must share one slice of at most {profile.max_devices(True)}"
                )
            out.append(SliceContent(devices=chunks[0], shared_counters=[cs]))
    else:
        step = profile.max_counter_sets_per_slice
        for i in range(0, len(counter_sets), step):
            out.append(SliceContent(shared_counters=counter_sets[i : i + step]))
        for cs in counter_sets:
            out += [SliceContent(devices=chunk) for chunk in pack(consumers[cs["name"]], profile)]
    out += [SliceContent(devices=chunk) for chunk in pack(plain, profile)]
    return out or [SliceContent()]
