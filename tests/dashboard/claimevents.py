"""Claim lifecycle events as the dashboard's GPU-hours read them: one builder for the tests."""

from __future__ import annotations

from shared.events.claims import ClaimLifecycle, PreparedDeviceRef


def claim_use(
    event: str, uid: str, at: float, devices: list[PreparedDeviceRef], ns: str = "team-a", node: str = "n1"
) -> ClaimLifecycle:
    """`event` (prepared, unprepared, rolled-back) of claim `uid` in `ns` on `node`, observed at `at`."""
    return ClaimLifecycle(
        event=event,  # type: ignore[arg-type]
        node=node,
        driver="gpu.nvidia.com",
        claim_uid=uid,
        claim_namespace=ns,
        claim_name=uid,
        devices=devices,
        observed_at=at,
    )
