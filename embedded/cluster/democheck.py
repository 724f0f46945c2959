"""What `gpu-dra demo` checks in every container's log: that it names exactly the GPUs and MIG devices the
container's claims were allocated, and shows the sharing their configs asked for: an MPS share's container its own
client limits, those its claim's consumedCapacity gives it, and no one else's.

Pure: pods, claims and ResourceSlices (as the API server returns them) in, expectations out; a log in, what is
wrong with it out. The truth is the claims' `status.allocation` (which devices) and the slices' `uuid` and
`parentUUID` attributes (which UUIDs); the log is what `nvidia-smi -L` (and `nvidia-smi -q`'s sharing lines)
printed inside the container.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.quantity import parse_quantity

DRIVER = "gpu.nvidia.com"
UUID_IN_LOG = re.compile(r"\(UUID: ((?:GPU|MIG)-[0-9A-Za-z-]+)\)")
MPS_RUNNING = re.compile(r"MPS Server\s*: Running")
MPS_CLIENT_ENV = re.compile(r"^(CUDA_MPS_(?:PINNED_DEVICE_MEM_LIMIT|ACTIVE_THREAD_PERCENTAGE)=\S*)$", re.MULTILINE)


def _time_slice(interval: str) -> re.Pattern[str]:
    return re.compile(rf"Time Slice Interval\s*: {re.escape(interval)}\b")


@dataclass(frozen=True)
class Expected:
    """What one container's log must show."""

    pod: str  # namespace/name
    container: str
    gpus: frozenset[str]  # the GPU UUIDs `nvidia-smi -L` lists: whole GPUs and the parents of MIG devices
    migs: frozenset[str]  # the MIG device UUIDs it lists under them
    sharing: tuple[str, ...] = ()  # TimeSlicing:<interval> or MPS, from the claims' opaque configs or MPS shares
    # an MPS share's client limits (`env | grep ^CUDA_MPS_`), from its claim's consumedCapacity: these and no others
    limits: frozenset[str] = frozenset()

    def complete(self, log: str) -> bool:
        """Every UUID, sharing line and limit it expects is in `log` (more output may still come)."""
        seen = set(UUID_IN_LOG.findall(log))
        return (
            self.gpus | self.migs <= seen
            and not self._missing_sharing(log)
            and self.limits <= set(MPS_CLIENT_ENV.findall(log))
        )

    def _missing_sharing(self, log: str) -> list[str]:
        missing = []
        for mode in self.sharing:
            if mode == "MPS" and not MPS_RUNNING.search(log):
                missing.append("no 'MPS Server : Running' line, though the claim's config asks for MPS")
            if mode.startswith("TimeSlicing:"):
                interval = mode.split(":", 1)[1]
                if not _time_slice(interval).search(log):
                    missing.append(
                        f"no 'Time Slice Interval : {interval}' line, though the claim's config "
                        f"asks for time-slicing with interval {interval}"
                    )
        return missing

    def mismatches(self, log: str) -> list[str]:
        """What is wrong with `log` (nothing: it names exactly this container's devices and sharing)."""
        seen = UUID_IN_LOG.findall(log)
        gpus = {u for u in seen if u.startswith("GPU-")}
        migs = {u for u in seen if u.startswith("MIG-")}
        wrong = []
        for kind, want, got in (("GPU", self.gpus, gpus), ("MIG device", self.migs, migs)):
            if got - want:
                wrong.append(f"names {kind}(s) it was not allocated: {', '.join(sorted(got - want))}")
            if want - got:
                wrong.append(f"does not name its allocated {kind}(s): {', '.join(sorted(want - got))}")
        limits = set(MPS_CLIENT_ENV.findall(log))
        if self.limits and self.limits - limits:
            wrong.append(f"does not show its share's MPS limits: {', '.join(sorted(self.limits - limits))}")
        if limits - self.limits:
            wrong.append(f"shows MPS limits that are not its share's: {', '.join(sorted(limits - self.limits))}")
        return wrong + self._missing_sharing(log)


def slice_devices(slices: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, str]]:
    """(pool, device) -> its string attributes, for the driver's devices in `slices`."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != DRIVER:
            continue
        for device in spec.get("devices") or []:
            attrs = {
                k.removeprefix(f"{DRIVER}/"): str(v["string"])
                for k, v in (device.get("attributes") or {}).items()
                if "string" in (v or {})
            }
            out[(spec["pool"]["name"], device["name"])] = attrs
    return out


def claim_names(pod: Mapping[str, Any]) -> dict[str, str]:
    """The pod's claim entry name -> the ResourceClaim's name (a template's generated claim from the status)."""
    names = {
        e["name"]: e["resourceClaimName"]
        for e in (pod.get("spec") or {}).get("resourceClaims") or []
        if e.get("resourceClaimName")
    }
    for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if status.get("resourceClaimName"):
            names[status["name"]] = status["resourceClaimName"]
    return names


def _matches(result_request: str, wanted: str) -> bool:
    return not wanted or result_request == wanted or result_request.startswith(wanted + "/")


def _sharing(claim: Mapping[str, Any], request: str) -> list[str]:
    modes = []
    for config in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("config") or []:
        if config.get("requests") and not any(_matches(request, r) for r in config["requests"]):
            continue
        opaque = config.get("opaque") or {}
        if opaque.get("driver") != DRIVER:
            continue
        sharing = (opaque.get("parameters") or {}).get("sharing") or {}
        if sharing.get("strategy") == "MPS":
            modes.append("MPS")
        elif sharing.get("strategy") == "TimeSlicing":
            modes.append("TimeSlicing:" + ((sharing.get("timeSlicingConfig") or {}).get("interval") or "Default"))
    return modes


def share_limits(result: Mapping[str, Any]) -> set[str]:
    """The MPS client limits an allocation result's share gets, as env lines: a share served by MPS consumes
    `compute` (percent of the SMs), and its `memory` (when not 0) becomes a pinned limit on device 0, in MiB."""
    consumed = result.get("consumedCapacity") or {}
    if not result.get("shareID") or "compute" not in consumed:
        return set()
    lines = {f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={int(parse_quantity(str(consumed['compute'])))}"}
    memory = parse_quantity(str(consumed.get("memory", "0")))
    if memory:
        lines.add(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={int(memory) >> 20}M")
    return lines


def expected(
    pod: Mapping[str, Any],
    claims: Mapping[str, Mapping[str, Any]],
    devices: Mapping[tuple[str, str], Mapping[str, str]],
) -> list[Expected]:
    """Per container of `pod`, what its log must show; `claims` by name, in the pod's namespace. A device the
    slices do not describe is expected by a placeholder UUID, so that the log cannot match it."""
    meta = pod["metadata"]
    names = claim_names(pod)
    out = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        gpus: set[str] = set()
        migs: set[str] = set()
        sharing: list[str] = []
        limits: set[str] = set()
        for ref in (container.get("resources") or {}).get("claims") or []:
            claim = claims.get(names.get(ref["name"], ""), {})
            results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
            for result in results:
                if result.get("driver") != DRIVER or not _matches(result.get("request", ""), ref.get("request", "")):
                    continue
                attrs = devices.get((result["pool"], result["device"]), {})
                uuid = attrs.get("uuid") or f"<no uuid published for {result['pool']}/{result['device']}>"
                if attrs.get("parentUUID"):
                    migs.add(uuid)
                    gpus.add(attrs["parentUUID"])
                else:
                    gpus.add(uuid)
                sharing += [m for m in _sharing(claim, result.get("request", "")) if m not in sharing]
                if share := share_limits(result):
                    limits |= share
                    sharing += [] if "MPS" in sharing else ["MPS"]
        if gpus or migs:
            out.append(
                Expected(
                    f"{meta['namespace']}/{meta['name']}",
                    container["name"],
                    frozenset(gpus),
                    frozenset(migs),
                    tuple(sharing),
                    frozenset(limits),
                )
            )
    return out
