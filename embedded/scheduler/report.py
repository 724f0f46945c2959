"""Why a claim could or could not be allocated on a node: the allocator's explanation, as data.

Owns the msgspec Structs the allocator fills and `explain.py` renders: per node, per request, how
many devices each check rejected (with example device names), the search-time conflicts
(matchAttribute, devices taken by the pod's other requests, counters), selector errors and
node-level problems (no slices, incomplete or invalid pools).
"""

from __future__ import annotations

import msgspec

SAMPLE = 4  # device names kept per rejection reason


class Rejection(msgspec.Struct, kw_only=True, gc=False):
    """One reason and the devices it applied to."""

    reason: str
    count: int = 0
    devices: list[str] = msgspec.field(default_factory=list)
    detailed: bool = False  # each device entry says `device: why` (e.g. the capacity left)

    def add(self, device: str) -> None:
        self.count += 1
        if len(self.devices) < SAMPLE:
            self.devices.append(device)


class RequestReport(msgspec.Struct, kw_only=True, gc=False):
    """One request (or firstAvailable subrequest) of one claim on one node."""

    claim: str  # namespace/name
    request: str  # `req` or `req/sub`
    device_class: str
    wanted: str  # "1", "3", "all"
    seen: int = 0  # devices visible from the node
    eligible: int = 0  # devices that passed every per-device check
    rejections: list[Rejection] = msgspec.field(default_factory=list)  # per-device checks, in check order
    conflicts: list[Rejection] = msgspec.field(default_factory=list)  # during the combined search
    error: str = ""  # a selector error or an impossible request: no device can be chosen
    allocated: list[str] = msgspec.field(default_factory=list)  # on success: chosen devices

    def rejection(self, reason: str, conflicts: bool = False) -> Rejection:
        bucket = self.conflicts if conflicts else self.rejections
        for r in bucket:
            if r.reason == reason:
                return r
        r = Rejection(reason=reason)
        bucket.append(r)
        return r


class NodeReport(msgspec.Struct, kw_only=True, gc=False):
    """One node's verdict for a pod's claims."""

    node: str
    fits: bool = False
    problem: str = ""  # node-level: no slices, invalid pool, search budget
    notes: list[str] = msgspec.field(default_factory=list)  # e.g. incomplete pools skipped
    requests: list[RequestReport] = msgspec.field(default_factory=list)

    def failed_requests(self) -> list[RequestReport]:
        return [r for r in self.requests if not r.allocated]


class ClaimProblem(msgspec.Struct, kw_only=True):
    """A claim that cannot be allocated anywhere as written (unknown class, bad selector, no admin access)."""

    claim: str
    message: str
