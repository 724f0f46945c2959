"""What a claim's device bills per second held: the one rule the example ledger (examples/ledger) and the fleet
page's GPU-hours panel (services/dashboard/gpuhours.py) both apply, so the two never disagree.

A whole GPU bills 1 GPU-second a second. A share of a GPU (a device of a claim event with a `share_id`, KEP-5075
consumable capacity) bills its fraction of the GPU (`share_fraction`): consumed memory over the device's memory
first, as a GPU's memory is what a share takes from everyone else. A MIG device bills 1 MIG-second of its
profile (a share of one: its fraction), priced per profile. Pure standard library (and shared.quantity, the
project's quantity parser, also standard library only): the example ledger imports it and nothing else of the
project, as a third party could copy these two files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from shared.quantity import QuantityError, parse_quantity

_MIG = re.compile(r"^gpu-\d+-mig-(.+)-\d+-\d+\Z", re.ASCII)
Kind = Literal["gpu", "share", "mig"]


def mig_profile(device: str) -> str | None:
    """`gpu-0-mig-1g24gb-19-0` -> `1g24gb`; None for a full GPU."""
    m = _MIG.match(device)
    return m.group(1) if m else None


def quantity(text: Any) -> float | None:
    """A Kubernetes quantity string (`10Gi`, `80G`, `25`, `500m`) as a number; None when it is not one."""
    try:
        return float(parse_quantity(str(text).strip()))
    except QuantityError:
        return None


def share_fraction(device: Mapping[str, Any]) -> float | None:
    """The fraction of its device a share bills for; None for a whole device (no `share_id`). `device` is a
    claim event's device as JSON (`PreparedDeviceRef`). In order: consumed memory over the device's memory
    (`capacity.memory`) when both are known and non-zero; else consumed `compute` percent / 100; else consumed
    `shares` over the device's `capacity.shares` (1/N); else 1, the whole device (a share whose size is unknown
    is never under-billed). Never more than 1."""
    if not device.get("share_id"):
        return None
    consumed = device.get("consumed_capacity") or {}
    capacity = device.get("capacity") or {}

    def ratio(name: str, whole: float | None) -> float | None:
        part = quantity(consumed[name]) if name in consumed else None
        if part is None or part <= 0 or whole is None or whole <= 0:
            return None
        return min(1.0, part / whole)

    for name, whole in (
        ("memory", quantity(capacity["memory"]) if "memory" in capacity else None),
        ("compute", quantity(capacity.get("compute", "100"))),
        ("shares", quantity(capacity["shares"]) if "shares" in capacity else None),
    ):
        fraction = ratio(name, whole)
        if fraction is not None:
            return fraction
    return 1.0


def billed_as(device: str, fraction: float | None) -> tuple[Kind, str, float]:
    """(kind, MIG profile or "", weight): what holding `device` (with its share fraction, None: all of it) for
    one second adds: a whole GPU ("gpu", "", 1), a share of a GPU ("share", "", fraction), a MIG device or a
    share of one ("mig", profile, fraction or 1)."""
    profile = mig_profile(device)
    if profile is not None:
        return "mig", profile, fraction or 1.0
    if fraction is not None:
        return "share", "", fraction
    return "gpu", "", 1.0
