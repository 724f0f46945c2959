"""What `gpu-dra demo` checks in every container's log: that it names exactly the GPUs and MIG devices the
container's claims were allocated, and shows the sharing their configs asked for.

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

DRIVER = "gpu.nvidia.com"
UUID_IN_LOG = re.compile(r"\(UUID: ((?:GPU|MIG)-[0-9A-Za-z-]+)\)")
MPS_RUNNING = re.compile(r"MPS Server\s*: Running")


def _time_slice(interval: str) -> re.Pattern[str]:
    return re.compile(rf"Time Slice Interval\s*: {re.escape(interval)}\b")


@dataclass(frozen=True)
class Expected:
    """What one container's log must show."""

    pod: str  # namespace/name
    container: str
    gpus: frozenset[str]  # the GPU UUIDs `nvidia-smi -L` lists: whole GPUs and the parents of MIG devices
    migs: frozenset[str]  # the MIG device UUIDs it lists under them
    sharing: tuple[str, ...] = ()  # TimeSlicing:<interval> or MPS, from the claims' opaque configs

    def complete(self, log: str) -> bool:
        """Every UUID and sharing line it expects is in `log` (more output may still come)."""
        seen = set(UUID_IN_LOG.findall(log))
        return self.gpus | self.migs <= seen and not self._missing_sharing(log)

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
        if gpus or migs:
            out.append(
                Expected(
                    f"{meta['namespace']}/{meta['name']}",
                    container["name"],
                    frozenset(gpus),
                    frozenset(migs),
                    tuple(sharing),
                )
            )
    return out
