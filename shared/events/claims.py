"""Claim lifecycle events from the preparer: what was prepared where, for whom, for how long."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.events.base import OBSERVED_AT, Message, doc

ClaimEventKind = Literal["prepare-started", "prepared", "prepare-failed", "unprepared", "rolled-back"]

FailureReason = Literal[
    "",
    "not-found",
    "not-allocated",
    "other-node",
    "invalid-config",
    "device-busy",
    "device-error",
    "timeout",
    "internal",
]
"""Why a prepare failed, as a class a consumer can count on (`prepare-failed` events; "" otherwise):
not-found (claim gone or replaced), not-allocated, other-node (allocated to another node or pool),
invalid-config (opaque config or allocation this driver refuses), device-busy (held by another claim,
or not ready yet), device-error (discovery or the device refused), timeout (a device operation ran past
its deadline), internal (checkpoint, CDI or anything else on this node)."""


class PreparedDeviceRef(msgspec.Struct, kw_only=True):
    """One device a claim got on a node."""

    request: Annotated[str, doc("The claim's request this device satisfies (spec.devices.requests[].name).")]
    pool: Annotated[str, doc("The ResourceSlice pool of the device (the node name for node-local GPUs).")]
    device: Annotated[str, doc("The device name in its ResourceSlice, e.g. gpu-0 or gpu-0-mig-1g.10gb-19-0.")]
    uuid: Annotated[str, doc("The GPU or MIG device UUID (GPU-... / MIG-...); empty for channels.")] = ""
    sharing: Annotated[str, doc("How the device is shared: '' (exclusive), TimeSlicing or MPS.")] = ""
    cdi_device_ids: Annotated[list[str], doc("The CDI device ids handed to the kubelet for this device.")] = (
        msgspec.field(default_factory=list)
    )
    share_id: Annotated[
        str,
        doc(
            "For a share of the device (KEP-5075 consumable capacity): the allocation "
            "result's shareID, one per share of the device; '' when the claim holds all "
            "of it."
        ),
    ] = ""
    consumed_capacity: Annotated[
        dict[str, str],
        doc(
            "For a share: what it consumes of the device, capacity name -> quantity, as allocated "
            '(consumedCapacity), e.g. {"memory": "10Gi", "compute": "10"}: memory in bytes, '
            "compute in percent of the device's SMs, shares a count; empty when the claim holds all of "
            "it."
        ),
    ] = msgspec.field(default_factory=dict)
    capacity: Annotated[
        dict[str, str],
        doc(
            "For a share: the device's whole capacity, as this node knows it, under the names in "
            "consumed_capacity, so a consumer can weigh the share: memory (the GPU's or MIG device's "
            "framebuffer), compute (100). A name the node does not know (shares: the count the cluster's "
            "NodeConfig sets) is absent; empty when the claim holds all of the device."
        ),
    ] = msgspec.field(default_factory=dict)


class ClaimLifecycle(Message, kw_only=True):
    """A step in a claim's life on a node. Subject `dra.v1.claim.<namespace>.<node>.<event>`."""

    event: Annotated[
        ClaimEventKind,
        doc(
            "The step: prepare-started, prepared, prepare-failed, unprepared or "
            "rolled-back (a prepare undone after a crash or failure)."
        ),
    ]
    node: Annotated[str, doc("The node the claim was prepared on; equals the subject's node token.")]
    driver: Annotated[str, doc("The DRA driver name, gpu.nvidia.com or compute-domain.nvidia.com.")]
    claim_uid: Annotated[str, doc("The ResourceClaim's metadata.uid.")]
    claim_namespace: Annotated[str, doc("The ResourceClaim's namespace; equals the subject's namespace token.")]
    claim_name: Annotated[str, doc("The ResourceClaim's name.")]
    devices: Annotated[
        list[PreparedDeviceRef],
        doc("The devices of the claim on this node (empty for prepare-started and prepare-failed)."),
    ] = msgspec.field(default_factory=list)
    error: Annotated[str, doc("For prepare-failed: what went wrong, for people; '' otherwise.")] = ""
    reason: Annotated[
        FailureReason,
        doc("For prepare-failed: the class of the failure, for programs (see FailureReason); '' otherwise."),
    ] = ""
    event_id: Annotated[
        str,
        doc(
            "Unique id of this event, `<node>/<claim uid>/<preparation>/<event>`; "
            "a resend keeps it, so de-duplicate on it. Also the CloudEvents id."
        ),
    ] = ""
    observed_at: Annotated[float, OBSERVED_AT] = 0.0


def claim_event_id(node: str, claim_uid: str, preparation: int, event: str) -> str:
    """The id the preparer on `node` gives a claim event: one per step of one preparation. `preparation`
    is the node's preparation sequence (in the preparer's checkpoint; it survives unprepare and restarts),
    so re-preparing a claim, a retry and a rollback each get ids of their own, while a resend of the same
    event keeps its id. Scoped by the node, which the event's subject authenticates, so no other node can
    mint an id that collides with it. (Ids from before 2026-12 are `<node>/<uid>/<event>/<generation>` or,
    older, lack the node.)"""
    return f"{node}/{claim_uid}/{preparation}/{event}"


def event_id_node(event_id: str) -> str | None:
    """The node a claim event id names; "" for an id without one (empty, or the older
    `<claim uid>/<event>/<generation>`); None for an id of neither shape."""
    parts = event_id.split("/")
    if event_id == "" or len(parts) == 3:
        return ""
    if len(parts) == 4 and all(parts):
        return parts[0]
    return None
