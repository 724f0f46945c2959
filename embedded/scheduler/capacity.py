"""Consumable capacity (KEP-5075): how much of a shareable device one allocation consumes.

Owns a device's capacities as exact values with their `requestPolicy`, and upstream's rules for
one request (k8s.io/dynamic-resource-allocation, `calculateConsumedCapacity` / `violatesPolicy`):
a capacity the request does not name consumes `requestPolicy.default`, else the device's whole
value; a named amount is rounded up to `validRange.min` and then to `min + n*step`, or to the
smallest `validValues` entry not below it; a rounded amount above `max`, off the step, or above
every valid value violates the policy (the device cannot take the request). Every capacity of the
device is consumed, named or not. Names compare with the driver's domain filled in (`memory` is
`<driver>/memory`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from embedded.scheduler.values import format_quantity, parse_quantity


def qualify(name: str, driver: str) -> str:
    return name if "/" in name else f"{driver}/{name}"


def _q(value: Any) -> Fraction | None:
    return None if value is None else parse_quantity(str(value))


class Capacity:
    """One capacity of a shareable device."""

    __slots__ = ("default", "key", "max", "min", "step", "valid_values", "value")

    def __init__(self, key: str, spec: Mapping[str, Any]):
        self.key = key  # as the slice spells it (the consumedCapacity key)
        self.value = parse_quantity(str(spec.get("value", "0")))
        policy = spec.get("requestPolicy") or {}
        self.default = _q(policy.get("default"))
        rng = policy.get("validRange") or {}
        self.min = _q(rng.get("min"))
        self.max = _q(rng.get("max"))
        self.step = _q(rng.get("step"))
        values = policy.get("validValues")
        self.valid_values = [parse_quantity(str(v)) for v in values] if values else None

    def consume(self, requested: Fraction | None) -> tuple[Fraction, str]:
        """The amount one allocation consumes, and why it violates the policy ("" when it does not)."""
        if requested is None:
            return (self.default if self.default is not None else self.value), ""
        amount = requested
        if self.min is not None:
            if amount < self.min:
                amount = self.min
            elif self.step:
                amount = self.min + self.step * math.ceil((amount - self.min) / self.step)
        elif self.valid_values is not None:
            amount = next((v for v in self.valid_values if requested <= v), requested)
        if self.default is not None and amount == self.default:
            return amount, ""
        if self.min is not None:
            if self.max is not None and amount > self.max:
                return amount, f"{format_quantity(requested)} is above the maximum {format_quantity(self.max)}"
        elif self.valid_values is not None and amount not in self.valid_values:
            return amount, (
                f"{format_quantity(requested)} is above every valid value "
                f"({', '.join(format_quantity(v) for v in self.valid_values)})"
            )
        return amount, ""


def device_capacities(device: Mapping[str, Any], driver: str) -> dict[str, Capacity]:
    """A shareable device's capacities by qualified name (QuantityError for a malformed one)."""
    return {qualify(str(k), driver): Capacity(str(k), v or {}) for k, v in (device.get("capacity") or {}).items()}


def consumption(
    capacities: Mapping[str, Capacity], requests: Mapping[str, Fraction]
) -> tuple[dict[str, Fraction], str]:
    """What one allocation of the device consumes per qualified capacity name (`requests` qualified
    too), and the first policy violation ("" when none)."""
    out: dict[str, Fraction] = {}
    for name, cap in capacities.items():
        amount, problem = cap.consume(requests.get(name))
        if problem:
            return out, f"capacity {cap.key}: request {problem}"
        out[name] = amount
    return out, ""


def shortage(
    capacities: Mapping[str, Capacity], need: Mapping[str, Fraction], *used: Mapping[str, Fraction] | None
) -> str:
    """`memory 10Gi of 80Gi left, request needs 20Gi` for every capacity `need` overruns ("" if none)."""
    short: list[str] = []
    for name, amount in need.items():
        cap = capacities[name]
        taken = sum(((u or {}).get(name, Fraction(0)) for u in used), Fraction(0))
        if taken + amount > cap.value:
            left = max(cap.value - taken, Fraction(0))
            short.append(
                f"{cap.key} {format_quantity(left)} of {format_quantity(cap.value)} left, "
                f"request needs {format_quantity(amount)}"
            )
    return "; ".join(short)


def consumed_text(capacities: Mapping[str, Capacity], amounts: Mapping[str, Fraction]) -> dict[str, str]:
    """The result's `consumedCapacity` map (keys as the slice spells them)."""
    return {capacities[name].key: format_quantity(amount) for name, amount in amounts.items()}
