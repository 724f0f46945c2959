"""The port between the claim state machine (`claimstate`) and a driver (GPU, channel): what a driver plans and does.

A driver writes no checkpoint state, CDI spec or event; the machine writes them all. `plan` checks a claim
before any side effect and says what its record holds; `apply` performs the side effects in order on the
record the machine made, yields `RECORD` before each one a crash could leave behind (the machine writes the
record as it stands before the driver goes on) and yields the claim's CDI edits last; `undo` reverses them
(idempotent). Drivers read other claims' records (guards, reference counts) through `ClaimRecords`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.preparer.host.cdi import CdiDevice, ContainerEdits
from services.preparer.host.checkpoint import ClaimRecord, ClaimState, PreparedDevice
from services.preparer.host.claims import AllocationResult, ResourceClaim
from services.preparer.host.devices import DeviceError
from services.preparer.host.metadatafiles import MetadataSource
from shared.events.claims import FailureReason


@dataclass(frozen=True)
class ClaimRef:
    uid: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.uid}"


class PrepareFailed(Exception):
    """A claim cannot be prepared as allocated (the message goes to the kubelet); `reason`: its class in the
    `prepare-failed` event; `reported`: that event is recorded; `claim`: as read, when a check of it failed."""

    def __init__(
        self,
        message: str,
        reason: FailureReason = "internal",
        *,
        reported: bool = False,
        claim: ResourceClaim | None = None,
    ) -> None:
        super().__init__(message)
        self.reason: FailureReason = reason
        self.reported = reported
        self.claim = claim


class Pending(PrepareFailed):
    """A side effect not done yet (a daemon not Ready): the claim stays PrepareStarted, the next prepare resumes."""


def failure_reason(exc: BaseException) -> FailureReason:
    """The class of an unexpected failure during a prepare's side effects."""
    if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
        return "timeout"
    if isinstance(exc, PrepareFailed):
        return exc.reason
    if isinstance(exc, DeviceError):
        return "device-error"
    return "internal"


@dataclass
class Plan:
    """What a claim's prepare holds and does, decided before any side effect."""

    devices: list[PreparedDevice]
    configs: list[dict[str, Any]] = field(default_factory=list)  # the record's decoded opaque configs
    fabric_partition: int = -1
    record_first: bool = False  # the first side effect needs the record on disk; else it is staged (`checkpoint`)
    work: Any = None  # the driver's own plan, handed back to its `apply`


class Record:
    """Yielded by `apply`: the claim's record, as it stands, goes to disk before the next side effect."""


RECORD = Record()


@dataclass
class SpecEdits:
    """A claim's CDI edits, yielded last by `apply`: one `CdiDevice` each (none: no spec), the spec-level
    edits, and the devices whose metadata files the spec mounts (KEP-5304; written when the host has them).
    `shared`: the edits are the same for every claim that holds these devices this way (shares), so the host
    serves them from one spec those claims use together (`sharedspecs`) unless the spec mounts metadata files."""

    devices: list[CdiDevice]
    common: ContainerEdits = field(default_factory=ContainerEdits)
    metadata: list[MetadataSource] = field(default_factory=list)
    shared: bool = False


class ClaimRecords(Protocol):
    """The checkpoint as a driver sees it: read only."""

    @property
    def claims(self) -> Mapping[str, ClaimRecord]: ...
    def holders(self, device: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]: ...
    def gpu_holders(self, gpu_uuid: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]: ...
    def daemon_users(self, daemon: str, *, exclude: str = "") -> Iterator[tuple[str, ClaimRecord, PreparedDevice]]: ...
    def holds(self, device: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]: ...
    def gpu_holds(self, gpu_uuid: str, *, exclude: str = "") -> list[tuple[str, ClaimRecord, PreparedDevice]]: ...
    def by_state(self, state: ClaimState) -> dict[str, ClaimRecord]: ...


class DriverPort(Protocol):
    # a PrepareStarted is a prepare in progress that the next call resumes (not one to roll back at start)
    resumable: bool

    async def plan(
        self, ref: ClaimRef, claim: ResourceClaim, results: list[tuple[int, AllocationResult]]
    ) -> Plan | None:
        """Check the claim (`results`: its allocation results of this driver) before any side effect;
        PrepareFailed when it cannot be prepared; None when it holds nothing of this driver."""

    def resumes(self, previous: ClaimRecord, plan: Plan) -> bool:
        """Whether a resumable driver's PrepareStarted `previous` is the prepare `plan` continues."""

    def apply(
        self, ref: ClaimRef, claim: ResourceClaim, plan: Plan, record: ClaimRecord
    ) -> AsyncGenerator[Record | SpecEdits, None]:
        """The side effects, in order (see the module doc); `Pending` keeps the record for the next call."""

    async def undo(self, uid: str, record: ClaimRecord) -> None:
        """Undo a claim's side effects, but its CDI spec and metadata files (idempotent)."""
